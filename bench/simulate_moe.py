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
    python bench/simulate_moe.py ab OUT.jsonl BASE.jsonl BASE_ROOT BASE_PYTHON [CONFIGS]

`ab` runs the same configs on this tree and on another checkout (`BASE_ROOT`, run by
`BASE_PYTHON`, whose `shardc` must be that checkout), interleaved config by config, the
order alternating, so both see the same load; each report gets `run_wall_s`, the run's wall
seconds. CONFIGS: MODEL:WORLDS;... (default "mixtral:128,256,512;deepseek_v3:128"). A
restructure that must not move a figure reruns this (docs/BENCHMARKS.md, issue 53).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"deepseek_v3": "DeepSeek-V3", "mixtral": "Mixtral 8x7B"}
STRATEGIES = ("ep_zero3", "ep2_zero3", "hpz_ep2", "paro_iig_ep_zero1")
WORLDS = (128, 256, 512)
GB = 1e9


def run(out: str, ranks: str = "0,last") -> None:
    for model in MODELS:
        for name in STRATEGIES:
            for world in WORLDS:
                _one(out, model, name, world, ranks)


def _one(out: str, model: str, name: str, world: int, ranks: str = "0,last", root: str = ROOT,
         python: str = sys.executable) -> None:
    """One config's simulated ranks on the checkout `root`, appended to `out`."""
    cmd = [python, "-m", "shardc.cli", "simulate", os.path.join(root, "examples/strategies/moe", f"{name}.shard"),
           "--mesh", f"node({world // 8}) > gpu(8)", "--model", os.path.join(root, f"examples/moe.py:{model}"),
           "--rank", ranks, "--tokens", "64", "--no-graph", "--no-peak", "--json"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    wall = time.perf_counter() - t
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise SystemExit(f"{root}: {model} {name} {world}: {proc.stderr.strip()[-2000:]}")
    with open(out, "a") as f:
        for rep in json.loads(proc.stdout):
            rep["model"], rep["run_wall_s"] = model, wall
            f.write(json.dumps(rep) + "\n")
    print(root, model, name, world, f"{wall:.1f} s", flush=True)


def ab(out: str, base_out: str, base_root: str, base_python: str,
       configs: str = "mixtral:128,256,512;deepseek_v3:128") -> None:
    """This tree and `base_root` on the same configs, interleaved (see the module notes)."""
    runs = [(m, name, int(w)) for part in configs.split(";") for m, ws in [part.split(":")]
            for name in STRATEGIES for w in ws.split(",")]
    for i, (model, name, world) in enumerate(runs):
        sides = [(out, ROOT, sys.executable), (base_out, base_root, base_python)]
        for o, root, py in (sides if i % 2 == 0 else sides[::-1]):
            _one(o, model, name, world, root=root, python=py)


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
    elif sys.argv[1] == "ab":
        ab(*sys.argv[2:7])
    else:
        print(table(sys.argv[2]))
