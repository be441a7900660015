"""`plan --memory M` against the simulated peak at scale (bench stage, issue 47 item 4):
the planner's top picks for a model on a mesh, and the first layout it rejects, each run as
a simulated rank (`shardc simulate`: torch's MemTracker over the real runtime under the fake
process group). Information and docs/BENCHMARKS.md's table; tests/test_plan_peak.py checks
the same property on a small model in the suite.

    python bench/plan_peak.py --out bench/results/simulate_DATE_plan-peak-llama30b.json

Default: LLaMA-30B (examples/llama.py `llama_30b`) on `node(16) > gpu(8)` (128 ranks),
M = 80 GiB, one micro-batch of one 2048-token sequence, AdamW, fp32 (plan's default
precision), `--overhead 0` (the tracker counts tensors: no framework overhead on either
side). Each layout: `plan --json`'s row (explain's peak and its phase), then `shardc
simulate` of its `.shard` text as rank 0 in a process of its own (the fake group is one per
process): the measured peak and its phase.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shardc(*argv: str) -> object:
    out = subprocess.run([sys.executable, "-c", "import sys; from shardc.cli import main; sys.exit(main(sys.argv[1:]))",
                          *argv], check=False, capture_output=True, text=True, cwd=ROOT)
    if not out.stdout.strip():
        raise SystemExit(f"shardc {' '.join(argv)} failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="examples/llama.py:llama_30b")
    ap.add_argument("--mesh", default="node(16) > gpu(8)")
    ap.add_argument("--memory", default="80GiB")
    ap.add_argument("--tokens", default="2048")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    common = ["--model", a.model, "--mesh", a.mesh, "--micro-batches", "1", "--tokens", a.tokens]
    t = time.perf_counter()
    doc = shardc("plan", *common, "--memory", a.memory, "--overhead", "0", "--top", str(a.top), "--json")
    rows = [dict(r, pick=i + 1) for i, r in enumerate(doc["ranking"])] + \
        ([dict(doc["rejected"], pick="rejected")] if doc["rejected"] else [])
    out = {"meta": {"model": a.model, "mesh": a.mesh, "memory": a.memory, "tokens": a.tokens, "rank": 0,
                    "candidates": doc["candidates"], "fit": doc["fit"], "plan_s": round(time.perf_counter() - t, 1),
                    "tracker": "torch.distributed._tools.mem_tracker.MemTracker (shardc simulate's)"}, "layouts": []}
    for r in rows:
        with tempfile.NamedTemporaryFile("w", suffix=".shard", delete=False) as f:
            f.write(r["shard"])
        t = time.perf_counter()
        got = shardc("simulate", f.name, *common, "--rank", "0", "--json")[0]
        os.remove(f.name)
        pk = got["peak"]
        out["layouts"].append({"pick": r["pick"], "params": r["params"], "grads": r["grads"], "optim": r["optim"],
                               "collectives": r["collectives"], "states": r["model_states"],
                               "explain_peak": r["memory"], "explain_phase": r["peak"]["phase"],
                               "measured_peak": pk["measured"], "measured_phase": pk["phase"],
                               "within": pk["within"], "simulate_s": round(time.perf_counter() - t, 1)})
        print(json.dumps(out["layouts"][-1]), flush=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print(table(out))


def table(r: dict) -> str:
    gib = 2 ** 30
    rows = ["| pick | params / grads / optim over | collectives | states | explain's peak (phase) | simulated peak (phase) |",
            "|---|---|---|---:|---:|---:|"]
    for x in r["layouts"]:
        lv = " / ".join(",".join(x[k]) or "-" for k in ("params", "grads", "optim"))
        rows.append(f"| {x['pick']} | {lv} | {x['collectives']} | {x['states'] / gib:.2f} | "
                    f"{x['explain_peak'] / gib:.2f} ({x['explain_phase']}) | {x['measured_peak'] / gib:.2f} ({x['measured_phase']}) |")
    return "\n".join(rows) + f"\n\n(GiB per rank, rank 0; M = {r['meta']['memory']})"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        with open(sys.argv[2]) as f:
            print(table(json.load(f)))
    else:
        main()
