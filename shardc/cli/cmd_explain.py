"""`shardc explain` — the cost model's report for one strategy on one model.

Input: a `.shard` file, a model factory (`PATH.py:FACTORY`, built on the meta device:
nothing is allocated), an optional world size / mesh override, micro-batches and
optimizer. Output: rich tables (memory per state, the per-step ledger, bytes per link
level with the intra/inter split, step time, tokens/s and MFU, the peak memory per
rank), or `--json`, or `--plot`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

from shardc.analysis.costmodel.memory import OPTIMIZERS
from shardc.analysis.costmodel.sizes import model_params
from shardc.cli import predict_args
from shardc.dsl.errors import ShardcError
from shardc.dsl.quantities import duration, flop_rate, human_bytes, parse_rate, parse_seconds
from shardc.lowering import Over
from shardc.lowering.optimizers import DEFAULT_OPTIMIZER
from shardc.lowering.passes import parse_passes
from shardc.dsl.ir import Collectives

# [Note: lazy imports] the CLI dispatcher imports every command module to build its
# parser, so this module (and cmd_plan, which shares the options below) imports neither
# torch nor the cost model's heavy parts at module level (`costmodel.memory` is plain
# arithmetic over the lowering).


def add_arguments(p) -> None:
    p.add_argument("file", help="strategy file (.shard)")
    p.add_argument("--model", required=True, metavar="PATH:FACTORY", help="model factory, e.g. examples/llama.py:llama_7b")
    predict_args.add_tp_argument(p)
    predict_args.add_ep_argument(p)
    p.add_argument("--world", type=int, help="world size (resolves `*` in the mesh)")
    p.add_argument("--mesh", help='mesh override, e.g. "node(8) > gpu(8)"')
    p.add_argument("--micro-batches", type=int, help="micro-batches per step (default: the strategy's accumulate)")
    p.add_argument("--optimizer", default=DEFAULT_OPTIMIZER, choices=OPTIMIZERS,
                   help=f"optimizer class (default {DEFAULT_OPTIMIZER})")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD/RMSprop momentum (states exist when non-zero)")
    p.add_argument("--collectives", choices=("auto", "ring", "hierarchical", "ho-ring"),
                   help="override the strategy's `collectives` (how multi-level groups are counted)")
    p.add_argument("--clip", action="store_true", help="count the clip_grad_norm_ all-reduce")
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"),
                   help="the process groups' backend: gloo reduce-scatters by all-to-all, whose receive "
                        "blocks the peak counts (default nccl)")
    p.add_argument("--passes", default=None, metavar="NAMES",
                   help='plan passes the run uses, comma-separated, as for `shardc compile --passes` '
                        '("" for none; default: all)')
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="draw this strategy among the named strategies")
    add_bandwidth_arguments(p)


def load(file: str, world, mesh, ep=None):
    """`load_strategy`, with a strategy error reduced to its first error line."""
    from shardc.dsl import StrategyError, load_strategy
    try:
        return load_strategy(file, world_size=world, mesh=mesh, ep=ep)
    except StrategyError as e:
        first = e.errors[0] if e.errors else None
        where = f"{first.span}: " if first is not None and first.span is not None else ""
        raise ShardcError(where + (first.message if first else str(e).splitlines()[0])) from None


def run(args) -> int:
    from shardc.analysis.costmodel.report import explain, to_json
    from shardc.cli.loader import load_model_units

    strategy = load(args.file, args.world, args.mesh, args.ep)
    if args.collectives:
        strategy = dataclasses.replace(strategy, collectives=Collectives(args.collectives))
    units = load_model_units(strategy, args.model, args.tp)
    kw = {"momentum": args.momentum}
    owned = any(o.owned for o in [strategy.optim] + [ov.optim for ov in strategy.overrides if ov.optim])
    bw = predict_args.links(args, bandwidth_from_args(args), strategy.mesh)
    rate = predict_args.achievable(args, flops_from_args(args, bw))
    graph = predict_args.graph(args, strategy, args.model, strategy.scopes.params.dtype.value)
    e = explain(strategy, units, micro_batches=args.micro_batches, optimizer=args.optimizer,
                optimizer_kwargs=kw, clip_grad_norm=args.clip, bandwidth=bw, tokens=args.tokens,
                flops=rate, graph=graph, checkpoint=args.checkpoint, peak_flops=predict_args.peak(args),
                overhead=predict_args.overhead(args), passes=parse_passes(args.passes), backend=args.backend)
    owners = []
    if owned:                    # `optim ... by tensor`: analysis/costmodel/owned.py
        from shardc.analysis.costmodel.memory import optimizer_state_bytes
        from shardc.analysis.costmodel.owned import explain_owned
        from shardc.cli.loader import meta_model
        from shardc.lowering.optimizers import OWNED_OPTIMIZER
        e, owners = explain_owned(e, meta_model(args.model, strategy, args.tp),
                                  k_flat=optimizer_state_bytes(args.optimizer, **kw),
                                  k_owned=optimizer_state_bytes(OWNED_OPTIMIZER), flops=rate,
                                  bandwidth=bw)
    if args.plot:
        from shardc.cli.plot import plot_among_named
        plot_among_named(e, args.model, args.plot, optimizer=args.optimizer, optimizer_kwargs=kw)
    if args.json:
        print(json.dumps(to_json(e), indent=2))
    else:
        render(e)
        for line in owners:
            print(line)
        counted = "6·params·tokens" if graph is None else "FLOPs counted on the traced graph"
        print(f"time model: {bw}; compute {args.tokens} tokens per micro-batch at {flop_rate(rate)} ({counted})")
    if args.plot:                # after the report; on stderr with --json, which keeps stdout JSON
        print(f"wrote the plot to {os.path.abspath(args.plot)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def render(e) -> None:
    from rich.console import Console
    from rich.table import Table

    s = e.strategy
    con = Console()
    phi, placed = model_params(e.units)
    experts = placed.get(Over.EXPERTS, 0)
    ep = s.experts.ep if s.experts is not None else 1
    of = (f" ({experts:,} of them experts" + (f", 1/{ep} of them on a rank: ep {ep} over {s.experts.level}"
                                             if ep > 1 else "") + ")") if experts else ""
    con.print(f"[bold]{s.name}[/bold] on mesh {s.mesh} (world {s.mesh.world}), {phi:,} parameters{of} "
              f"in {len(e.units)} units, {e.micro_batches} micro-batches per step, collectives {e.algo.value}")
    mem = Table(title="memory per rank (model states)")
    mem.add_column("state")
    mem.add_column("bytes", justify="right")
    mem.add_column("", justify="right")
    for k in ("params", "params_secondary", "grads", "optim", "total", "transient"):
        mem.add_row(k, f"{e.memory[k]:,}", human_bytes(e.memory[k]))
    con.print(mem)
    con.print(f"start-up peak per rank: {human_bytes(e.memory['startup'])} (the shards, and the largest unit's "
              f"whole parameters or a load's staging while they get values; optimizer states come at the "
              f"first step)", highlight=False)
    led = Table(title="communication ledger per step (logical collectives)")
    for c in ("phase", "op", "levels", "bytes", "count", "total"):
        led.add_column(c, justify="right" if c in ("bytes", "count", "total") else "left")
    for r in e.ledger:
        levels = ",".join(r.levels) + (f" ({r.over})" if r.over != "dense" else "")
        led.add_row(r.phase, r.op, levels, f"{r.bytes:,}", str(r.count), human_bytes(r.bytes * r.count))
    con.print(led)
    lk = Table(title=f"bytes each rank sends per step, by link level ({e.algo.value})")
    lk.add_column("level")
    lk.add_column("bytes", justify="right")
    lk.add_column("", justify="right")
    shared = e.shared or {}
    for level, b in e.links.items():
        on = f" (on {shared[level]}'s link)" if level in shared else ""
        lk.add_row(level + on, f"{round(b):,}", human_bytes(b))
    lk.add_row("inter (outermost)", f"{round(e.inter):,}", human_bytes(e.inter))
    lk.add_row("intra (all others)", f"{round(e.intra):,}", human_bytes(e.intra))
    con.print(lk)
    t = e.time
    con.print(f"step time estimate: {duration(t.total)} (compute {duration(t.compute)}, exposed "
              f"communication {duration(t.exposed)}; " +
              ", ".join(f"{k} {duration(v)}" for k, v in t.comm.items()) + ")")
    r, pk = e.rates, e.peak
    con.print(f"throughput: {_readable(r['tokens_per_s'])} tokens/s per rank, MFU {_readable(100 * r['mfu'])} %")
    parts = [f"states {human_bytes(pk['states'])}", f"gathered units {human_bytes(pk['gathered'])}",
             f"overhead {human_bytes(pk['overhead'])}"]
    if pk["peak"] is None:       # no sum without the activations: it would read as the peak
        con.print("peak memory per rank: not estimated, activations not counted (no trace); without them: "
                  + ", ".join(parts), highlight=False)
    else:
        at = [f"{k} {human_bytes(v)}" for k, v in (pk.get("buffers") or {}).items()]
        con.print(f"peak memory per rank: {human_bytes(pk['peak'])}, in the {pk.get('phase')}: "
                  f"{' + '.join(at)} + overhead {human_bytes(pk['overhead'])}; dominated by {pk['dominant']}",
                  highlight=False)
    for w in s.warnings:
        con.print(w, markup=False, highlight=False)


def _readable(x: float) -> str:
    """A rate as printed: whole above 100, one decimal above 1, two significant digits below
    (a 7B model predicted at a CPU's rate runs at a fraction of a token per second, not "0")."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2g}"


# -- options shared with `shardc plan` ------------------------------------------------

def add_bandwidth_arguments(p) -> None:
    g = p.add_argument_group("time model")
    g.add_argument("--intra", default="100GB/s", help="bandwidth per rank of the in-node link, which every inner level shares (default 100GB/s)")
    g.add_argument("--inter", default="12.5GB/s", help="bandwidth per rank of the outermost level's links (default 12.5GB/s)")
    g.add_argument("--intra-latency", default="5us", help="latency per ring step on inner links (default 5us)")
    g.add_argument("--inter-latency", default="20us", help="latency per ring step on outer links (default 20us)")
    g.add_argument("--bandwidth", metavar="F.json", action="append",
                   help="measured profile from `shardc profile` (replaces --intra/--inter); repeat it to merge "
                        "profiles of one mesh taken at different times (the median of each entry)")
    g.add_argument("--tokens", type=int, default=4096, help="tokens per rank per micro-batch (default 4096)")
    g.add_argument("--flops", default=None,
                   help="achievable FLOP/s per rank (default: the --bandwidth profile's measured rate, else 150e12)")
    predict_args.add_prediction_arguments(g)


def bandwidth_from_args(args):
    from shardc.analysis.costmodel.profile import Profile
    from shardc.analysis.costmodel.timing import AlphaBeta
    if args.bandwidth:
        return Profile.load(*args.bandwidth)
    return AlphaBeta(intra=parse_rate(args.intra), inter=parse_rate(args.inter),
                     intra_lat=parse_seconds(args.intra_latency), inter_lat=parse_seconds(args.inter_latency))


def flops_from_args(args, bw=None) -> float:
    """`--flops`, else the measured rate of a profile `bw` ([Note: measured compute rate]), else 150e12."""
    measured = getattr(bw, "flops", None)
    if args.flops is None and measured is not None:
        return measured
    try:
        f = float("150e12" if args.flops is None else args.flops)
    except ValueError:
        f = -1.0
    if f <= 0:
        raise ShardcError(f"--flops must be a positive number of FLOP/s, got {args.flops!r}")
    if args.tokens < 1:
        raise ShardcError(f"--tokens must be at least 1, got {args.tokens}")
    return f

