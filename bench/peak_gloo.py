"""Peak on real gloo ranks — explain's memory timeline against torch's MemTracker, per phase,
for every named strategy (examples/strategies/*.shard) on the small HF GPT-2 and Llama of
bench/peak_models.py at 4 and 8 CPU gloo ranks (bench stage; information only).

    python bench/peak_gloo.py -o bench/results/systems_100gbit_DATE_peak-gloo.jsonl [--worlds 4,8] [--only zero3]
    python bench/peak_gloo.py --render bench/results/systems_100gbit_DATE_peak-gloo.jsonl   # docs tables
        [--simulated bench/results/simulate_DATE_peak-sweep-gpt2-4.jsonl,...]   # with simulate's column
    python bench/peak_gloo.py --reexplain FILE       # explain's columns again after a timeline change
    python bench/peak_gloo.py --probe --worlds 4 --models gpt2_small --only zero3   # rank 0's live storages by site

Per (model, world) one pool of gloo ranks (tests/harness.py `dist_run`) runs each strategy in
turn as a training loop would: `shardc.compile` on the model built from its config (no
weights), the strategy's own `accumulate` micro-batches of 1 x 64 random tokens per rank
(cross entropy, divided by the micro-batches), AdamW (foreach), `opt.step()`,
`opt.zero_grad()`. The first step makes the optimizer's states; the second runs under the
MemTracker subclass `shardc simulate` uses (shardc/simulate.py `_step_tracker`: the same
phases, forward / backward / step, the same external tensors), so a real rank and a
simulated one are measured alike. Beside each: explain's timeline point for each phase and
its peak (without the framework overhead) as `explain --backend gloo` computes it (the gloo
reduce-scatter's receive blocks counted), and, with --simulate, `shardc simulate`'s measured
peak for rank 0 (fake process group, meta tensors). Output: one JSON line per run (the max
over ranks and rank 0's measured peaks per phase, explain's).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(ROOT))        # `shardc` (the repo root is the package)
sys.path.insert(0, ROOT)                        # tests.harness
sys.path.insert(0, os.path.join(ROOT, "bench"))
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "hsdp_zero2", "mics", "zeropp", "paro_iig", "paro_nig", "paro_igg",
              "zero_topo", "lins_7b"]
MODELS = ["gpt2_small", "llama_small"]
MESHES = {4: "node(2) > gpu(2)", 8: "node(2) > gpu(4)"}
TOPO = {4: "node(1) > gpu(2) > gcd(2)", 8: "node(2) > gpu(2) > gcd(2)"}    # zero_topo's 3 levels
TOKENS = 64
PHASES = ("forward", "backward", "step")


def mesh_of(strategy: str, world: int) -> str:
    return (TOPO if strategy == "zero_topo" else MESHES)[world]


def shard_path(strategy: str) -> str:
    return os.path.join(ROOT, "examples", "strategies", f"{strategy}.shard")


def simulated(strategy: str, model: str, world: int) -> dict:
    """`shardc simulate --json` as rank 0 (fake process group): its measured peak."""
    cmd = [sys.executable, "-m", "shardc.cli", "simulate", shard_path(strategy),
           "--model", os.path.join(ROOT, "bench", "peak_models.py") + f":{model}", "--world", str(world),
           "--mesh", mesh_of(strategy, world), "--rank", "0", "--tokens", str(TOKENS), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if not p.stdout.strip():
        raise RuntimeError(p.stderr.strip()[-600:])
    return json.loads(p.stdout)[0]["peak"]


def explained(strategy: str, model: str, world: int):
    """explain on gloo (`backend="gloo"`: the reduce-scatters' receive blocks), traced as
    `shardc simulate` traces: (micro-batches, states bytes, the peak dict, {phase: bytes})."""
    from types import SimpleNamespace

    from shardc.analysis.costmodel.report import explain, model_units
    from shardc.analysis.costmodel.timeline import MEASURED
    from shardc.cli import predict_args
    from shardc.cli.cmd_explain import load
    from shardc.cli.loader import load_factory
    from shardc.simulate import meta_model
    spec = os.path.join(ROOT, "bench", "peak_models.py") + f":{model}"
    strat = load(shard_path(strategy), world, mesh_of(strategy, world))
    args = SimpleNamespace(no_graph=False, seq=None, tokens=TOKENS, tp=1, checkpoint=False)
    graph = predict_args.graph(args, strat, spec, strat.scopes.params.dtype.value)
    units = model_units(strat, meta_model(load_factory(spec), spec))
    e = explain(strat, units, graph=graph, backend="gloo")
    tl = {p["phase"]: p["bytes"] for p in e.peak["timeline"]}
    return e.micro_batches, int(e.memory["total"]), e.peak, {ph: max(tl[p] for p in MEASURED[ph]) for ph in PHASES}


def rank_step(rank: int, world: int, strategy: str, model: str, micro_batches: int, probe: bool = False) -> dict:
    """One gloo rank: compile, one untracked step, one tracked step (per phase). `probe`:
    rank 0 also lists the live storages by allocation site at each phase's peak
    (bench/peak_probe.py `probing`)."""
    import contextlib
    import gc

    import torch
    import torch.nn.functional as F

    import peak_models
    import shardc
    from shardc.cli.cmd_explain import load
    from shardc.runtime.memory import held_tensors
    from shardc.simulate import _step_tracker

    torch.manual_seed(0)
    strat = load(shard_path(strategy), world, mesh_of(strategy, world))
    net = getattr(peak_models, model)()
    g = torch.Generator().manual_seed(1 + rank)
    xs = [torch.randint(0, peak_models.V, (1, TOKENS), generator=g) for _ in range(micro_batches)]
    sm = shardc.compile(net, strat, example_inputs=(xs[0],))
    opt = sm.optimizer(torch.optim.AdamW, lr=1e-3)

    def step(phase):
        for x in xs:
            with phase("forward"):
                out = sm(x)
                logits = out if torch.is_tensor(out) else out[0]
                loss = F.cross_entropy(logits.flatten(0, -2).float(), x.flatten()).div(micro_batches)
            del out, logits      # as shardc simulate's loop ([Note: the loop drops the output before backward])
            with phase("backward"):
                loss.backward()
            del loss
        with phase("step"):
            opt.step()
            opt.zero_grad()

    step(lambda name: contextlib.nullcontext())
    gc.collect()
    make, found = _step_tracker, {}
    if probe and rank == 0:
        from peak_probe import probing
        make, found = probing(_step_tracker)
    tracker = make()
    tracker.track_external(*held_tensors(sm.runtime, sm.params), opt)
    with tracker:
        step(tracker.phase)
    out = {"phases": tracker.phase_peaks(), "by_kind": tracker.peak_by_kind(), "probe": found}
    del sm, opt, tracker, net
    gc.collect()
    return out


def run(strategy: str, model: str, world: int, probe: bool = False, sim: bool = False) -> dict:
    from tests.harness import dist_run
    m, states, peak, per = explained(strategy, model, world)
    ranks = dist_run(world, rank_step, strategy, model, m, probe)
    if probe:
        tl = {x["phase"]: x for x in peak["timeline"]}
        from shardc.analysis.costmodel.timeline import MEASURED
        for name, (total, live) in ranks[0]["probe"].items():
            print(f"== {name}: gloo rank 0 {total:,}  explain {per[name]:,}")
            for k, v in sorted(live.items(), key=lambda kv: -kv[1]):
                if v:
                    print(f"   {v:>12,}  {k}")
            at = max((tl[p] for p in MEASURED[name] if p in tl), key=lambda p: p["bytes"])
            for k, v in at["buffers"].items():
                print(f"   explain {v:>12,}  {k}")
    phases = {ph: max(r["phases"][ph] for r in ranks) for ph in PHASES}
    out = {"model": model, "strategy": strategy, "mesh": mesh_of(strategy, world), "world": world,
           "micro_batches": m, "states": states, "backend": "gloo",
           "measured": max(phases.values()), "phase": max(phases, key=phases.get), "phases": phases,
           "rank0_phases": ranks[0]["phases"], "by_kind": ranks[0]["by_kind"],
           "explain": peak["peak"] - peak["overhead"], "explain_phase": peak["phase"], "explain_phases": per,
           "explain_buffers": peak["buffers"]}
    if sim:
        s = simulated(strategy, model, world)
        out.update(simulated=s["measured"], simulated_explain=s["explain"])
    return out


def join_simulated(rows: list[dict], paths: list[str]) -> None:
    """Each row's `simulated` (rank 0's measured peak under `shardc simulate`, the fake group)
    and `simulated_explain` (explain's, native reduce-scatters) from bench/peak_sweep.py's files."""
    sims = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    sims[(r["model"], r["strategy"], r["world"])] = r
    for r in rows:
        s = sims.get((r["model"], r["strategy"], r["world"]))
        if s is not None and "error" not in s:
            r.update(simulated=s["measured"], simulated_explain=s["explain"])


def render(rows: list[dict]) -> str:
    out = ["| model | ranks | strategy | states | explain's peak, gloo (phase) | measured, gloo (phase) | "
           "explain / measured | per phase: fwd, bwd, step | simulated (explain / simulated) |",
           "|---|---:|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['world']} | {r['strategy']} | error: {r['error'][-100:]} |||||")
            continue
        per = ", ".join(f"{r['explain_phases'][ph] / r['phases'][ph]:.3f}" for ph in PHASES)
        sim = (f"{r['simulated']:,} ({r['simulated_explain'] / r['simulated']:.3f})" if "simulated" in r else "")
        out.append(f"| {r['model']} | {r['world']} | {r['strategy']} | {r['states']:,} | {r['explain']:,} "
                   f"({r['explain_phase']}) | {r['measured']:,} ({r['phase']}) | {r['explain'] / r['measured']:.3f} "
                   f"| {per} | {sim} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--out")
    ap.add_argument("--only")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--render")
    ap.add_argument("--simulated", metavar="FILES", help="--render: join bench/peak_sweep.py's results (comma-separated)")
    ap.add_argument("--reexplain", metavar="FILE", help="recompute explain's columns of FILE in place, then render")
    ap.add_argument("--probe", action="store_true", help="print rank 0's live storages by site at each phase's peak")
    ap.add_argument("--simulate", action="store_true", help="also rank 0 of `shardc simulate` (fake group)")
    a = ap.parse_args()
    if a.reexplain:                     # explain's columns again (the timeline changed), measured kept
        with open(a.reexplain) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for r in rows:
            if "error" not in r:
                m, states, peak, per = explained(r["strategy"], r["model"], r["world"])
                r.update(states=states, explain=peak["peak"] - peak["overhead"], explain_phase=peak["phase"],
                         explain_phases=per, explain_buffers=peak["buffers"])
        with open(a.reexplain, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        a.render = a.reexplain
    if a.render:
        with open(a.render) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if a.simulated:
            join_simulated(rows, a.simulated.split(","))
        print(render(rows))
        return
    from tests.harness import shutdown
    for world in map(int, a.worlds.split(",")):
        for model in a.models.split(","):
            for s in (a.only.split(",") if a.only else STRATEGIES):
                try:
                    r = run(s, model, world, a.probe, a.simulate)
                except Exception as e:  # noqa: BLE001 — one failed run is a row, not the end of the sweep
                    r = {"model": model, "strategy": s, "world": world, "error": str(e)[-600:]}
                    print(json.dumps(r), flush=True)
                else:
                    print(render([r]).splitlines()[-1], flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(json.dumps(r) + "\n")
        shutdown()


if __name__ == "__main__":
    main()
