"""gloo reduce-scatter: native op against all-to-all + local sum (information only).

    python bench/gloo_reduce_scatter.py [--ranks 2,4] [--sizes 64KB,1MB,8MB,32MB] [--repeat 7]

Spawns `--ranks` local gloo processes (torch.multiprocessing, loopback TCP,
`OMP_NUM_THREADS=1`) and times one flat reduce-scatter of each input size (the full
buffer, fp32) two ways: `dist.reduce_scatter_single` (gloo implements it as an
all-reduce followed by a slice) and what shardc's runtime issues on gloo groups,
`all_to_all_single` followed by a local sum over the received chunks
(runtime/eager/collectives.py "[Note: reduce-scatter on gloo]"). Both results are checked
against each other. Prints, per world size and size, the median time of `--repeat`
calls after one warm-up (the two ways interleaved, each call starts after a barrier; rank 0's wall time, the
sum included) and the ratio native / all-to-all. No timing is asserted anywhere.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

UNITS = {"KB": 1 << 10, "MB": 1 << 20, "B": 1}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for u, mult in UNITS.items():
        if t.endswith(u):
            return int(float(t[:-len(u)]) * mult)
    return int(t)


def _a2a_sum(out: torch.Tensor, inp: torch.Tensor, s: int) -> None:
    recv = torch.empty_like(inp)
    dist.all_to_all_single(recv, inp)
    torch.sum(recv.view(s, -1), 0, out=out)


def _native(out: torch.Tensor, inp: torch.Tensor, s: int) -> None:
    dist.reduce_scatter_single(out, inp)


def _times(out_a, out_n, inp, s, repeat) -> tuple[float, float]:
    """Median seconds of (native, all-to-all + sum), the two interleaved so load drifts hit both."""
    _native(out_n, inp, s)
    _a2a_sum(out_a, inp, s)
    tn, ta = [], []
    for _ in range(repeat):
        for fn, out, acc in ((_native, out_n, tn), (_a2a_sum, out_a, ta)):
            dist.barrier()
            t0 = time.perf_counter()
            fn(out, inp, s)
            acc.append(time.perf_counter() - t0)
    return statistics.median(tn), statistics.median(ta)


def _worker(rank: int, world: int, sizes: list[int], repeat: int, port: int, q) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for nbytes in sizes:
        n = nbytes // 4 // world * world
        inp = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        a, b = torch.empty(n // world), torch.empty(n // world)
        tn, ta = _times(a, b, inp, world, repeat)
        torch.testing.assert_close(a, b)
        rows.append((nbytes, tn, ta))
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sizes", default="64KB,256KB,1MB,4MB,8MB,32MB")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--port", type=int, default=29571)
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| ranks | size | native reduce_scatter (ms) | all_to_all + sum (ms) | native / a2a |")
    print("|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for k, world in enumerate(int(w) for w in args.ranks.split(",")):
        q = ctx.SimpleQueue()
        mp.start_processes(_worker, args=(world, sizes, args.repeat, args.port + k, q), nprocs=world,
                           start_method="spawn")
        for nbytes, tn, ta in q.get():
            label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
            print(f"| {world} | {label} | {tn * 1e3:.2f} | {ta * 1e3:.2f} | {tn / ta:.2f} |", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
