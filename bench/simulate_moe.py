"""MoE shapes on simulated ranks (issue 48, docs/simulate.md) — stage: benchmark (information only).

Input: examples/moe.py's `deepseek_v3` and `mixtral` factories (the papers' shapes on the
meta device, experts placed on the simulated rank's ep mesh) and the shipped MoE strategies
(examples/strategies/moe/*.shard) on `node(N/8) > gpu(8)` for N = 128, 256, 512. Output:
one JSON line per simulated rank (`shardc simulate --json`, states and ledger only:
`--no-graph --no-peak`, 64 tokens a micro-batch, the strategy's accumulate), and
`table` renders them as markdown: the model states per rank and the step's ledger by level
set, simulated beside explain. GB = 10^9 bytes. Usage:
    python bench/simulate_moe.py run OUT.jsonl [RANKS]   # RANKS default "0,last"
    python bench/simulate_moe.py table OUT.jsonl
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"deepseek_v3": "DeepSeek-V3", "mixtral": "Mixtral 8x7B"}
STRATEGIES = ("ep_zero3", "ep2_zero3", "hpz_ep2", "paro_iig_ep_zero1")
WORLDS = (128, 256, 512)
GB = 1e9


def run(out: str, ranks: str = "0,last") -> None:
    with open(out, "a") as f:
        for model in MODELS:
            for name in STRATEGIES:
                for world in WORLDS:
                    cmd = [sys.executable, "-m", "shardc.cli", "simulate",
                           os.path.join(ROOT, "examples/strategies/moe", f"{name}.shard"),
                           "--mesh", f"node({world // 8}) > gpu(8)", "--model",
                           os.path.join(ROOT, f"examples/moe.py:{model}"), "--rank", ranks,
                           "--tokens", "64", "--no-graph", "--no-peak", "--json"]
                    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                    if proc.returncode not in (0, 1) or not proc.stdout.strip():
                        raise SystemExit(f"{model} {name} {world}: {proc.stderr.strip()[-2000:]}")
                    for rep in json.loads(proc.stdout):
                        rep["model"] = model
                        f.write(json.dumps(rep) + "\n")
                    print(model, name, world, "done", flush=True)


def _ledger(rep, key: str) -> float:
    return sum(r["bytes"] * r["count"] for r in rep[key]) / GB


def table(path: str) -> str:
    with open(path) as f:
        reps = [json.loads(line) for line in f if line.strip()]
    groups: dict = {}
    for r in reps:
        groups.setdefault((r["model"], r["strategy"], r["world"]), []).append(r)
    lines = ["| model | strategy | ranks | states / rank, GB (explain) | ledger / step / rank, GB (explain) "
             "| states, ledger = explain (ranks) | s / rank |",
             "|---|---|---:|---:|---:|---|---:|"]
    for (model, name, world), rs in sorted(groups.items(), key=lambda kv: (list(MODELS).index(kv[0][0]),
                                                                          STRATEGIES.index(kv[0][1]), kv[0][2])):
        r0 = rs[0]
        ok = sum(r["memory_equal"] and r["ledger_equal"] for r in rs)
        secs = max(sum(v["wall"] for v in r["seconds"].values()) for r in rs)
        lines.append(f"| {MODELS[model]} | {name} | {world} | {r0['memory']['total'] / GB:.2f} "
                     f"({r0['explain_memory']['total'] / GB:.2f}) | {_ledger(r0, 'ledger'):.1f} "
                     f"({_ledger(r0, 'explain_ledger'):.1f}) | {'yes' if ok == len(rs) else 'NO'} "
                     f"({', '.join(str(r['rank']) for r in rs)}) | {secs:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], *sys.argv[3:4])
    else:
        print(table(sys.argv[2]))
