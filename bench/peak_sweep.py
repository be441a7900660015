"""Peak sweep — explain's memory timeline against torch's MemTracker, per phase, for every
named strategy (examples/strategies/*.shard) on small HF GPT-2 and Llama
(bench/peak_models.py) at 4 and 8 ranks, each rank 0 of `shardc simulate --json` (one
process each, the strategy's own `accumulate`).

    python bench/peak_sweep.py [-o bench/results/simulate_DATE_peak-sweep.json] [--only zero3,ddp]
    python bench/peak_sweep.py --render bench/results/simulate_DATE_peak-sweep.json   # the markdown table

Output: one JSON line per run (model, strategy, mesh, explain's timeline and phase, the
measured per-phase peaks) and, with --render, docs/explain.md's per-strategy table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "hsdp_zero2", "mics", "zeropp", "paro_iig", "paro_nig", "paro_igg",
              "zero_topo", "lins_7b"]
MODELS = ["gpt2_small", "llama_small"]
MESHES = {4: "node(2) > gpu(2)", 8: "node(2) > gpu(4)"}
TOPO = {4: "node(1) > gpu(2) > gcd(2)", 8: "node(2) > gpu(2) > gcd(2)"}    # zero_topo's 3 levels
TOKENS = 64


def run(strategy: str, model: str, world: int) -> dict:
    mesh = (TOPO if strategy == "zero_topo" else MESHES)[world]
    cmd = [sys.executable, "-m", "shardc.cli", "simulate", os.path.join(ROOT, "examples", "strategies", f"{strategy}.shard"),
           "--model", os.path.join(ROOT, "bench", "peak_models.py") + f":{model}", "--world", str(world),
           "--mesh", mesh, "--rank", "0", "--tokens", str(TOKENS), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if not p.stdout.strip():
        return {"model": model, "strategy": strategy, "mesh": mesh, "world": world, "error": p.stderr.strip()[-400:]}
    rep = json.loads(p.stdout)[0]
    peak = rep["peak"]
    return {"model": model, "strategy": strategy, "mesh": mesh, "world": world, "rc": p.returncode,
            "micro_batches": rep["step"]["micro_batches"], "states": rep["memory"]["total"],
            "measured": peak["measured"], "phases": peak["phases"], "phase": peak["phase"],
            "explain": peak["explain"], "explain_phase": peak["explain_phase"],
            "timeline": peak["explain_timeline"], "within": peak["within"]}


def explained(r: dict, phase: str) -> int:
    """explain's bytes for a measured phase (timeline.py `MEASURED`: the backward spans the sync)."""
    from shardc.analysis.costmodel.timeline import MEASURED
    tl = {p["phase"]: p["bytes"] for p in r["timeline"]}
    return max(tl[p] for p in MEASURED[phase])


def _ratio(r: dict) -> float:
    return r["explain"] / r["measured"]


def render(rows: list[dict]) -> str:
    out = ["| model | ranks | strategy | states | explain's peak (phase) | measured (phase) | explain / measured "
           "| per phase: explain / measured (fwd, bwd, step) |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['world']} | {r['strategy']} | error: {r['error'][-80:]} ||||")
            continue
        per = ", ".join(f"{explained(r, ph) / r['phases'][ph]:.3f}" for ph in ("forward", "backward", "step")
                        if ph in r["phases"])
        out.append(f"| {r['model']} | {r['world']} | {r['strategy']} | {r['states']:,} | {r['explain']:,} "
                   f"({r['explain_phase']}) | {r['measured']:,} ({r['phase']}) | {_ratio(r):.3f} | {per} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--out")
    ap.add_argument("--only")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--render")
    a = ap.parse_args()
    if a.render:
        with open(a.render) as f:
            print(render([json.loads(line) for line in f if line.strip()]))
        return
    rows = []
    for model in a.models.split(","):
        for world in map(int, a.worlds.split(",")):
            for s in (a.only.split(",") if a.only else STRATEGIES):
                r = run(s, model, world)
                rows.append(r)
                print(json.dumps(r) if a.out is None else render([r]).splitlines()[-1], flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(json.dumps(r) + "\n")
    if a.out:
        print(render(rows))


if __name__ == "__main__":
    main()
