"""Benchmark shardc against FSDP2 and DDP on an emulated multi-node cluster.

    python bench/cluster_bench.py --nodes 2 --per-node 4 --inter-rate 250mbit \\
        --accumulate 4 --steps 3 --systems fsdp2:full,fsdp2:hsdp,ddp,shardc:zero3 --json out.json
    python bench/cluster_bench.py --collectives --nodes 2 --per-node 4 --json coll.json

Stage: flags -> EmulatedCluster (bench/netns.py) -> one torchrun job per system
(bench/worker.py) or one collectives job (bench/collectives_worker.py) -> JSON
`{"config": {...}, "systems": {name: {...}}}` (bench/report.py) or
`{"config": {...}, "collectives": [...]}`. Same model, data and seeds for every system;
a failed system is reported with its error and the others still run. Needs root and
iproute2; says so and exits 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from launch import progress_poller, run_job
from models import PRESETS
from netns import ClusterError, ClusterSpec, EmulatedCluster, remove_stale, require_root_and_tools

HERE = os.path.dirname(os.path.abspath(__file__))
console = Console(stderr=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=4)
    p.add_argument("--inter-rate", default="250mbit", help="tc rate of each inter-node link")
    p.add_argument("--inter-delay", default=None, help="one-way inter-node delay, e.g. 0.1ms")
    p.add_argument("--per-rank-links", action="store_true",
                   help="one shaped link per rank instead of one per node")
    p.add_argument("--model", default="bench", help=f"{'|'.join(PRESETS)} or PATH.py:FACTORY")
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the system list this many times, alternating, and pool the steps ([Note: rounds]); "
                        "with --bandwidth-profile, the profile's --sweeps")
    p.add_argument("--systems", default="fsdp2:full,fsdp2:hsdp,ddp,shardc:zero3",
                   help="comma-separated; NAME+tp (or +tpN) adds tensor parallelism over N=2 ranks of a node "
                        "([Note: +tp systems] in bench/peers/systems.py), e.g. fsdp2+tp,shardc:zero3+tp; a peer's "
                        "+compile runs it under torch.compile, a shardc system's +inductor in shardc's whole-step "
                        "compiled mode ([Note: system suffixes]), e.g. fsdp2:full+compile,shardc:zero3+inductor; "
                        "+epN / +epgpu expert parallelism on --model moe ([Note: +ep systems] in bench/peers/ep_systems.py), "
                        "e.g. fsdp2+ep2,shardc:moe/ep2_zero3+ep2")
    p.add_argument("--timeout", type=float, default=600, help="seconds per system")
    p.add_argument("--collectives", action="store_true",
                   help="time all-gather/reduce-scatter, flat vs hierarchical, instead")
    p.add_argument("--sizes", default="64KB,1MB,8MB,32MB", help="--collectives message sizes")
    p.add_argument("--bandwidth-profile", metavar="OUT.json", default=None,
                   help="run `shardc profile` on the cluster instead (collectives and, for --model bench, "
                        "the compute rate; --steps/--warmup runs per entry) -> OUT.json for explain --bandwidth")
    p.add_argument("--profile-sizes", default="128KiB,1MiB,4MiB,16MiB", help="--bandwidth-profile message sizes")
    p.add_argument("--profile-comm", default="fp32,int8,int4", help="--bandwidth-profile wire dtypes")
    p.add_argument("--logdir", default=None, help="worker logs (default: a fresh temp dir)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler on rank 0 over the timed steps -> LOGDIR/<system>.profile.txt")
    p.add_argument("--json", dest="json_out", required=True)
    return p.parse_args(argv)


def check_args(a) -> str | None:
    if a.nodes < 1 or a.per_node < 1:
        return "--nodes and --per-node must be at least 1"
    if a.accumulate < 1 or a.steps < 1 or a.warmup < 0 or a.micro_batch < 1 or a.rounds < 1:
        return "--accumulate, --steps, --rounds and --micro-batch must be at least 1, --warmup at least 0"
    from peers.systems import parse_system
    for s in a.systems.split(","):
        try:
            n = parse_system(s)
        except ValueError as e:
            return str(e)
        if a.per_node % n.tp:
            return f"system {s!r}: tp {n.tp} does not divide --per-node {a.per_node} (a tp group stays inside a node)"
        if n.ep.isdigit() and a.per_node % int(n.ep):
            return f"system {s!r}: ep {n.ep} does not divide --per-node {a.per_node} (an ep group stays inside a node)"
    if a.model not in PRESETS and ":" not in a.model:
        return f"unknown model {a.model!r}: use {', '.join(PRESETS)} or PATH.py:FACTORY"
    return None


def config(a) -> dict:
    return {"nodes": a.nodes, "per_node": a.per_node, "world": a.nodes * a.per_node,
            "inter_rate": a.inter_rate, "inter_delay": a.inter_delay,
            "per_rank_links": a.per_rank_links, "model": a.model, "accumulate": a.accumulate,
            "micro_batch": a.micro_batch, "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds,
            "cpu_count": os.cpu_count(), "torch": _torch_version(),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _torch_version() -> str:
    import torch
    return torch.__version__


def run_system(cluster, a, name: str, index: int, logdir: str, progress, task, round_: int = 0) -> dict:
    from report import summarize

    tag = name.replace(":", "_").replace("/", "_") + (f".round{round_ + 1}" if a.rounds > 1 else "")
    out, prog = os.path.join(logdir, f"{tag}.json"), os.path.join(logdir, f"{tag}.progress")
    for path in (out, prog):
        if os.path.exists(path):
            os.remove(path)
    flags = ["--system", name, "--model", a.model, "--nodes", str(a.nodes),
             "--per-node", str(a.per_node), "--accumulate", str(a.accumulate),
             "--micro-batch", str(a.micro_batch), "--steps", str(a.steps),
             "--warmup", str(a.warmup), "--out", out, "--progress", prog]
    if a.per_rank_links:
        flags.append("--per-rank-links")
    if a.profile:
        flags += ["--profile", os.path.join(logdir, f"{tag}.profile.txt")]

    job = run_job(cluster, os.path.join(HERE, "worker.py"), flags, logdir, tag,
                  port=29400 + index, timeout=a.timeout,
                  poll=progress_poller(progress, task, prog, name))
    if job.ok and os.path.exists(out):
        with open(out) as f:
            res = json.load(f)
        if "error" not in res:
            return summarize(name, res, a.model, a.nodes, a.per_node, a.accumulate)
    return {"error": _first_error(out, a.nodes * a.per_node, job), "log_tail": job.tail()}


def _first_error(out: str, world: int, job) -> str:
    for path in [out] + [f"{out}.rank{r}" for r in range(1, world)]:
        if os.path.exists(path):
            with open(path) as f:
                res = json.load(f)
            if "error" in res:
                return res["error"]
    if job.timed_out:
        return f"timed out after {job.seconds:.0f}s"
    return f"torchrun exited with {list(job.returncodes)} (see log_tail)"


def run_systems(cluster, a, logdir: str) -> dict:
    """Every system, `a.rounds` times over, alternating ([Note: rounds] in report.py)."""
    from report import merge_rounds

    names = a.systems.split(",")
    rounds = {n: [] for n in names}
    per_run = a.warmup + a.steps
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        tasks = [progress.add_task(n, total=per_run) for n in names]
        for r in range(a.rounds):
            for i, (name, task) in enumerate(zip(names, tasks)):
                label = name if a.rounds == 1 else f"{name} (round {r + 1}/{a.rounds})"
                progress.update(task, description=f"{label}: starting", completed=0)
                res = run_system(cluster, a, name, r * len(names) + i, logdir, progress, task, r)
                rounds[name].append(res)
                done = "failed" if "error" in res else f"{res['step_time_s']:.3f}s/step"
                progress.update(task, description=f"{label}: {done}", completed=per_run)
    return {n: merge_rounds(rs) for n, rs in rounds.items()}


def print_table(systems: dict) -> None:
    t = Table(title="median step time, tokens/s, model states, bytes per rank per step (a2a: tokens sent to experts)")
    for col in ("system", "step s", "tok/s", "state MB", "node MB", "gpu MB", "node MB (wire)", "a2a MB"):
        t.add_column(col, justify="right")
    for name, r in systems.items():
        if "error" in r:
            t.add_row(name, "error: " + r["error"][:60], "", "", "", "", "", "")
            continue
        lb, mb = r["level_bytes"], r.get("measured_bytes") or {}
        t.add_row(name, f"{r['step_time_s']:.3f}", f"{r['tokens_per_s']:.0f}",
                  f"{r['model_state_bytes'] / 1e6:.2f}", f"{lb.get('node', 0) / 1e6:.2f}",
                  f"{lb.get('gpu', 0) / 1e6:.2f}", f"{mb.get('node', 0) / 1e6:.2f}",
                  f"{r.get('a2a_bytes', 0) / 1e6:.2f}")
    console.print(t)


def main(argv=None) -> int:
    a = parse_args(argv)
    problem = check_args(a)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        require_root_and_tools()
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name in remove_stale():
        console.print(f"removed {name}, left behind by a run that was killed")
    logdir = a.logdir or tempfile.mkdtemp(prefix="shardc-bench-")
    try:
        os.makedirs(logdir, exist_ok=True)
    except OSError as e:
        print(f"error: cannot use --logdir {logdir}: {e.strerror}", file=sys.stderr)
        return 1
    spec = ClusterSpec(a.nodes, a.per_node, a.inter_rate, a.inter_delay, a.per_rank_links)
    doc = {"config": config(a)}
    try:
        with EmulatedCluster(spec) as cluster:
            if a.collectives:
                from collectives_run import run_collectives
                doc["collectives"] = run_collectives(cluster, a, logdir, console)
            elif a.bandwidth_profile:
                from profile_run import run_profile
                doc["profile"] = run_profile(cluster, a, logdir, console)
            else:
                doc["systems"] = run_systems(cluster, a, logdir)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the emulated cluster was torn down", file=sys.stderr)
        return 130
    with open(a.json_out, "w") as f:
        json.dump(doc, f, indent=1)
    if "systems" in doc:
        print_table(doc["systems"])
    console.print(f"wrote {a.json_out} (worker logs in {logdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
