"""Command-line options shared by `shardc explain` and `shardc plan`: the bandwidth
model (`--intra/--inter` bandwidths and latencies, or `--bandwidth profile.json`) and
the compute figures of the step-time estimate.
"""
from __future__ import annotations

from shardc.dsl.errors import ShardcError

# [Note: lazy imports] the CLI dispatcher imports every command module to build its
# parser, so nothing here (or in cmd_explain / cmd_plan) imports torch at module level.


def add_bandwidth_arguments(p) -> None:
    g = p.add_argument_group("time model")
    g.add_argument("--intra", default="100GB/s", help="bandwidth per rank of the inner levels' links (default 100GB/s)")
    g.add_argument("--inter", default="12.5GB/s", help="bandwidth per rank of the outermost level's links (default 12.5GB/s)")
    g.add_argument("--intra-latency", default="5us", help="latency per ring step on inner links (default 5us)")
    g.add_argument("--inter-latency", default="20us", help="latency per ring step on outer links (default 20us)")
    g.add_argument("--bandwidth", metavar="F.json", help="measured profile from `shardc profile` (replaces --intra/--inter)")
    g.add_argument("--tokens", type=int, default=4096, help="tokens per rank per micro-batch (default 4096)")
    g.add_argument("--flops", default="150e12", help="achievable FLOP/s per rank (default 150e12)")


def bandwidth_from_args(args):
    from shardc.compiler.costmodel.timing import AlphaBeta, Profile, parse_rate, parse_seconds
    if args.bandwidth:
        return Profile.load(args.bandwidth)
    return AlphaBeta(intra=parse_rate(args.intra), inter=parse_rate(args.inter),
                     intra_lat=parse_seconds(args.intra_latency), inter_lat=parse_seconds(args.inter_latency))


def flops_from_args(args) -> float:
    try:
        f = float(args.flops)
    except ValueError:
        f = -1.0
    if f <= 0:
        raise ShardcError(f"--flops must be a positive number of FLOP/s, got {args.flops!r}")
    if args.tokens < 1:
        raise ShardcError(f"--tokens must be at least 1, got {args.tokens}")
    return f


def human_bytes(n: float) -> str:
    """Binary units, three significant digits: 1.50 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"
