"""Per-micro-batch CPU, page faults and collectives of one shardc system (bench stage: torchrun
rank -> one JSON of every rank's figures).

Input: torchrun's environment (plain loopback gloo, no namespaces) and the flags below.
Output: rank 0 writes `--out`: per rank, each timed micro-batch's wall seconds, CPU seconds
of the process (`time.process_time`: every thread, gloo's too) and minor page faults
(`ru_minflt`), the peak RSS; rank 0's collectives (torch.distributed calls: name, group size,
input and output bytes) and the step's losses.

Why these figures: on a shared machine wall time is mostly other people's load, while a
rank's own CPU seconds and page faults, and the list of collectives, depend on the code.
This is how issue 48's hpZ slowdown was found (docs/BENCHMARKS.md, "hpZ (zeropp) against
e24a095"): the same collectives and bytes on both trees, more CPU and 5-10x the page
faults per micro-batch on main, from the codec's working copies.

    torchrun --standalone --nproc-per-node 4 bench/codec_trace.py --nodes 2 --per-node 2 --out OUT.json

`--profile P` writes each rank's cProfile (main thread's CPU time) of the timed micro-batches to `P.rankN` (the
CPU figures of that run include the profiler's own cost; compare profiled runs only with
profiled runs). `--rows N` sets runtime/transport/quant.py's ROWS_AT_ONCE for the run (the codec's batch, to compare
bounds on one tree). The script runs on older trees too (it reads only the bench helpers and
shardc's public API), which is how e24a095 was measured beside main.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models import batch, build_model
try:
    from peers.systems import build_system
except ImportError:                  # trees before the restructure (e24a095): bench/systems.py
    from systems import build_system

CALLS: list = []
COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_to_all_single", "all_to_all",
               "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce", "broadcast")


def _bytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_bytes(y) for y in x)
    return x.numel() * x.element_size() if torch.is_tensor(x) else 0


def count_collectives() -> None:
    """Record every collective the runtime issues through torch.distributed (while CALLS is on)."""
    for name in COLLECTIVES:
        f = getattr(dist, name, None)
        if f is None:
            continue

        def spy(*a, _f=f, _n=name, **k):
            g = k.get("group")
            CALLS.append((_n, dist.get_world_size(g) if g is not None else dist.get_world_size(),
                          _bytes(a[0]), _bytes(a[1]) if len(a) > 1 else 0))
            return _f(*a, **k)
        setattr(dist, name, spy)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--system", default="shardc:zeropp")
    p.add_argument("--model", default="bench")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--per-node", type=int, required=True)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--profile", default=None,
                   help="write each rank's cProfile of the timed step's micro-batches to PROFILE.rankN")
    args = p.parse_args()
    os.environ["LOCAL_WORLD_SIZE"] = str(args.per_node)      # `gpu(local)`: the emulated node's ranks
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.rows:
        from shardc.runtime.transport import quant
        quant.ROWS_AT_ONCE = args.rows
    model = build_model(args.model)
    sys_ = build_system(args.system, model, args.nodes, args.per_node,
                        batch(model, 0, 0, 0, args.micro_batch)[0], args.accumulate)
    count_collectives()
    mine = {}
    prof = None
    for step in range(args.warmup + 1):
        if args.profile and step == args.warmup:
            import cProfile
            prof = cProfile.Profile(time.thread_time)   # this thread's CPU, not wall time (a loaded machine)
        dist.barrier()
        CALLS.clear()
        micro, losses = [], []
        for i in range(args.accumulate):
            x, y = batch(model, step, i, rank, args.micro_batch)
            t, c = time.perf_counter(), time.process_time()
            f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if prof is not None:
                prof.enable()
            logits = sys_.model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            (loss / args.accumulate).backward()
            if prof is not None:
                prof.disable()
            micro.append({"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c,
                          "minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f})
            losses.append(float(loss))
        sys_.opt.step()
        sys_.opt.zero_grad()
        mine = {"micro": micro, "losses": losses,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}
    if prof is not None:
        prof.dump_stats(f"{args.profile}.rank{rank}")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        calls = collections.Counter(CALLS)
        with open(args.out, "w") as fh:
            json.dump({"system": args.system, "model": args.model, "mesh": [args.nodes, args.per_node],
                       "rows_at_once": args.rows, "ranks": gathered,
                       "collectives": [[*k, v] for k, v in sorted(calls.items())]}, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
