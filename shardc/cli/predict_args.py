"""Prediction options shared by `shardc explain` and `shardc plan`.

Input: parsed arguments. Output: the compute side of the time model (achievable and
peak FLOP/s), per-level links (`--link LEVEL=BW[@LAT]`, any number of levels; the
`--intra/--inter` pair stays the two-tier shorthand), and the model's traced
`GraphCost` (FLOPs and activations of one micro-batch of `--tokens` tokens in
sequences of `--seq`, with or without `--checkpoint`). torch is imported lazily.
"""
from __future__ import annotations

import sys

from shardc.cli.argtypes import positive_int
from shardc.dsl.errors import ShardcError
from shardc.dsl.quantities import parse_memory


def add_prediction_arguments(g) -> None:
    g.add_argument("--link", action="append", default=[], metavar="LEVEL=BW[@LAT]",
                   help="bandwidth (and latency) per rank of one mesh level's links, e.g. --link node=25GB/s "
                        "--link gpu=200GB/s@5us; repeat per level (levels not named use --intra/--inter, an inner one "
                        "the first inner level's link); "
                        "LEVEL=OTHER puts a level on another level's links, e.g. --link lane=gpu")
    g.add_argument("--tflops", type=float, help="achievable TFLOP/s per rank (replaces --flops)")
    g.add_argument("--peak-tflops", type=float, default=312.0,
                   help="peak TFLOP/s per rank that MFU divides by (default 312: A100/A800 bf16 dense)")
    g.add_argument("--seq", type=positive_int, help="sequence length (default: --tokens, one sequence per micro-batch)")
    g.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every non-root unit")
    g.add_argument("--overhead", metavar="BYTES",
                   help="framework memory per rank counted in the peak (default 2GiB: CUDA context, buffers)")
    g.add_argument("--no-graph", action="store_true",
                   help="skip tracing the model: compute = 6·params·tokens, activations and the peak not counted "
                        "(explain only: plan bounds the peak)")


def add_tp_argument(p) -> None:
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="tensor-parallel degree: every block's attention and MLP linears split over N "
                        "ranks (the torchtitan plan); states and bytes are a local shard's")


def add_ep_argument(p, plan: bool = False) -> None:
    p.add_argument("--ep", metavar="N|LEVEL", type=_ep_value,
                   help="expert-parallel degree: N ranks of the innermost level, or a whole level, each holding "
                        "its own experts (replaces the `experts` statement's ep; the experts are counted on one ep "
                        "rank, split along dim 0)" if not plan else
                        "expert-parallel degree (N ranks of the innermost level, or a whole level): every candidate "
                        "gets `experts \"PATTERN\" ep N`, its experts sharded by its scopes over the ranks ep leaves")
    if plan:
        p.add_argument("--experts", default="*.experts", metavar="PATTERN",
                       help='glob naming the expert parameters or their modules with --ep (default "*.experts")')


def _ep_value(text: str):
    """`--ep 2` -> 2, `--ep gpu` -> "gpu" (the DSL checks either against the mesh)."""
    return int(text) if text.lstrip("-").isdigit() else text


def achievable(args, fallback: float) -> float:
    if args.tflops is None:
        return fallback
    if args.tflops <= 0:
        raise ShardcError(f"--tflops must be positive, got {args.tflops:g}")
    return args.tflops * 1e12


def peak(args) -> float:
    if args.peak_tflops <= 0:
        raise ShardcError(f"--peak-tflops must be positive, got {args.peak_tflops:g}")
    return args.peak_tflops * 1e12


def overhead(args):
    """`--overhead` in bytes, or None for the cost model's stated default."""
    if args.overhead is None:
        return None
    return 0 if str(args.overhead).strip() in ("0", "0B") else int(parse_memory(args.overhead))


def links(args, fallback, mesh):
    """`--link` options over the fallback (the two tiers, or a measured profile, which
    must be of this mesh), checked against the mesh."""
    if not args.link:
        if hasattr(fallback, "check"):
            fallback.check(mesh)
        return fallback
    if getattr(args, "bandwidth", None):
        raise ShardcError("--link and --bandwidth both describe the links; give a measured profile or --link, not both")
    from shardc.analysis.costmodel.network import parse_links
    out = parse_links(args.link, fallback)
    out.check(mesh)
    return out


def graph(args, strategy, spec: str, dtype: str, *, need: str | None = None):
    """The traced GraphCost of one micro-batch. Without one (`--no-graph`, or a model the
    meta trace cannot run) the activations are unknown, so there is no peak: `explain`
    says so (a note on stderr when the trace failed) and `need` (what requires the peak,
    for `plan`) makes it one ShardcError sentence. With `--tp` a failed trace is one
    sentence too: the cut did not fit the model's attention (analysis/costmodel/tp.py,
    [Note: local head counts])."""
    if args.no_graph:
        if need:
            raise ShardcError(f"--no-graph leaves the activations out, but {need}: drop --no-graph")
        return None
    seq = args.seq or args.tokens
    if seq < 1 or args.tokens % seq:
        raise ShardcError(f"--tokens {args.tokens} must be a whole number of --seq {seq} sequences")
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.analysis.costmodel.flops import trace, unit_dtypes
    from shardc.cli.loader import meta_model
    from shardc.units import find_units
    model = meta_model(spec, strategy, args.tp)
    try:
        units = find_units(model, resolve_bucket(model, strategy))
        return trace(model, units, batch=args.tokens // seq, seq=seq, dtype=unit_dtypes(strategy, units, dtype))
    except Exception as e:  # noqa: BLE001 — a model the meta trace cannot run: say so
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if args.tp > 1:
            raise ShardcError(f"--tp {args.tp}: {spec} does not trace with its attention and MLP split over "
                              f"{args.tp} ranks ({why}); its attention must read a local head count (`n_heads` "
                              f"beside a fixed `head_dim`, divided by the cut) or infer it (`view(b, t, -1, "
                              f"head_dim)`)") from None
        if need:
            raise ShardcError(f"{spec} does not trace on the meta device ({why}), but {need}") from None
        print(f"note: cannot trace {spec} on the meta device ({why}); compute is estimated as 6·params·tokens, "
              f"activations are not counted and the peak memory is not estimated", file=sys.stderr)
        return None
