"""`shardc profile -o bandwidth.json [--sizes ...] [--mesh M]` — measure collective bandwidth.

Input: a running world (under torchrun, or an already initialised default process
group) and a mesh. Output (rank 0): a JSON bandwidth profile read by the cost model
(`analysis/costmodel/profile.py`, `--bandwidth F.json`):

    {"mesh": [{"name", "size"}], "device": "cpu", "entries":
       [{"op", "levels", "algo", "bytes", "seconds", "cpu_seconds", "busbw"}],
     "compute": {...}}          # only with --model (profile_compute.py)

For every set of mesh levels whose factor is > 1 (levels in mesh order), every op
(all_gather, reduce_scatter, all_reduce), every algorithm (ring only for one level) and
every size, the runtime's own collectives (`shardc.runtime.eager.collectives`) are timed.
`bytes` is the logical full size of the collective, as in the ledger (fp32 payload);
`seconds` is the median over `--iters` runs (after `--warmup` runs; × `--sweeps`, the
times the whole list is timed over) of each run's slowest rank ([Note: a robust
collective time]; every group of the level set runs at the same time, as in
training); `cpu_seconds` (CPU
only, else null) the process CPU time per run, mean over ranks: the part of the
collective that occupies a core ([Note: CPU share of a collective] in profile.py);
`busbw` is nccl-tests' bus bandwidth: bytes/seconds times (s-1)/s for gathers and
scatters, 2(s-1)/s for all-reduce. With `--model`, the achievable compute rate is
measured too (`profile_compute.py`).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

from shardc.analysis.costmodel.links import FACTOR
from shardc.cli import profile_compute
from shardc.cli.argtypes import positive_int
from shardc.dsl.quantities import parse_bytes
from shardc.lowering import Op

OPS = tuple(op.value for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE))   # as --ops and the file spell them


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", required=True, metavar="F.json", help="where rank 0 writes the profile")
    p.add_argument("--sizes", nargs="+", type=_size, default=[2**16, 2**20, 2**24], metavar="BYTES",
                   help="logical message sizes, e.g. 64KiB 1MiB 16MiB (default)")
    p.add_argument("--mesh", default=None, metavar="M",
                   help='mesh, e.g. "node(2) > gpu(4)" (default: node(WORLD/LOCAL) > gpu(LOCAL_WORLD_SIZE))')
    p.add_argument("--algos", nargs="+", default=["ring", "hierarchical", "ho-ring"],
                   choices=["ring", "hierarchical", "ho-ring"], help="algorithms to time (default: all)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS), help="collectives to time (default: all)")
    p.add_argument("--comm", nargs="+", default=["fp32"], choices=["fp32", "int8", "int4"],
                   help="wire dtypes to time (default fp32); int8/int4 time the runtime's quantized all_gather "
                        "(qwZ) and reduce-scatter (qgZ, one all_to_all), codec work included")
    p.add_argument("--iters", type=positive_int, default=5, help="timed runs per entry (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per entry (default 1)")
    p.add_argument("--sweeps", type=positive_int, default=1,
                   help="time every entry this many times over, in turn, and pool the runs (default 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="tensor device (default: cuda when available, else cpu)")
    profile_compute.add_arguments(p)


def _size(text: str) -> int:
    n = parse_bytes(text)
    if n is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 4096, 64KiB or 16MB, got {text!r}")
    n = int(n)
    if n < 4:
        raise argparse.ArgumentTypeError(f"a message size must be at least 4 bytes, got {text!r}")
    return n


def _default_mesh_text() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return f"node({world // local}) > gpu({local})" if world > local else f"gpu({world})"


def _init_world(device: str) -> bool:
    """Join the torchrun world unless a default group exists; True when this call created it."""
    import torch.distributed as dist

    from shardc.dsl.errors import ShardcError

    if dist.is_initialized():
        return False
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ShardcError("shardc profile measures a running world: launch it with torchrun, "
                          "e.g. `torchrun --nproc-per-node 4 -m shardc.cli profile -o bw.json`")
    if device == "cuda":
        import torch
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return True


def level_sets(mesh) -> list[tuple[str, ...]]:
    """Every non-empty set of levels with factor > 1, in mesh order (size-1 levels dropped)."""
    names = [l.name for l in mesh.levels if l.size > 1]
    return [c for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]


def _bus_factor(op: Op, s: int) -> float:
    return (s - 1) / s * FACTOR[op]


def _launch(op, sm, levels, algo, bufs, C, comm):
    full, shard = bufs
    if op is Op.ALL_GATHER:
        return C.all_gather(full, shard, sm, levels, algo=algo, comm=comm)
    if op is Op.REDUCE_SCATTER:
        return C.reduce_scatter(shard, full, sm, levels, algo=algo, comm=comm)
    return C.all_reduce(full, sm, levels, algo=algo)


def _time_one(op, sm, levels, algo, n, args, device, comm) -> tuple[list[float], float | None]:
    """(each run's seconds on its slowest rank, CPU seconds per run or None off CPU); see
    [Note: a robust collective time]."""
    import torch
    import torch.distributed as dist

    from shardc.runtime.eager import collectives as C

    s = sm.mesh.factor(levels)
    bufs = (torch.ones(n, device=device), torch.ones(n // s, device=device))
    for _ in range(args.warmup):
        _launch(op, sm, levels, algo, bufs, C, comm).wait()
    _sync(device)
    dist.barrier()
    runs, c0 = [], time.process_time()
    for _ in range(args.iters):
        t0 = time.perf_counter()
        _launch(op, sm, levels, algo, bufs, C, comm).wait()
        _sync(device)
        runs.append(time.perf_counter() - t0)
    cpu = torch.tensor([(time.process_time() - c0) / args.iters], dtype=torch.float64, device=device)
    wall = torch.tensor(runs, dtype=torch.float64, device=device)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return wall.tolist(), (float(cpu.item()) / dist.get_world_size() if device == "cpu" else None)


# [Note: a robust collective time]
# An entry's `seconds` is the median over its runs of each run's slowest rank. Each run
# is timed on its own (a collective returns when this rank's part is done; on CUDA after
# a synchronize), the ranks' times are combined per run with a MAX (the run took as long
# as its slowest rank), and the median drops the runs that an unrelated process or the
# scheduler of an oversubscribed CPU stretched. With `--sweeps S` the whole list of
# entries is timed S times over and each entry pools its runs of every sweep: runs that
# follow one another share the state of the links (on the emulated cluster, a shaped
# link's TCP state), so two profiles taken minutes apart disagreed on one entry by up to
# 1.9x with 7 runs in one go, and a step-time prediction built on them by up to 7 %.


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def _plan(mesh, args) -> list[tuple[Op, tuple[str, ...], str, int, str]]:
    """(op, levels, algo, logical bytes, comm) to time; quantized: all_gather and the
    reduce-scatter (one flat all_to_all, so ring only), no all_reduce."""
    jobs = []
    for levels in level_sets(mesh):
        algos = ["ring"] if len(levels) == 1 else args.algos
        for comm, op, algo, size in itertools.product(args.comm, map(Op, args.ops), algos, args.sizes):
            quantized = comm != "fp32"
            if quantized and (op is Op.ALL_REDUCE or (op is Op.REDUCE_SCATTER and algo != "ring")):
                continue
            jobs.append((op, levels, algo, size, comm))
    return jobs


def _numel(size: int, s: int) -> int:
    """fp32 elements of a `size`-byte collective over a group of s, a multiple of s."""
    return max(s, size // 4 // s * s)


def _entry(job, mesh, runs: list[float], cpus: list[float]) -> dict:
    """One profile entry from its pooled runs ([Note: a robust collective time])."""
    from statistics import median

    from shardc.dsl.ir import DType
    from shardc.lowering import payload_bytes

    op, levels, algo, size, comm = job
    s, dt = mesh.factor(levels), DType(comm)
    wire = payload_bytes(_numel(size, s), s, dt)   # what the ledger records for this collective
    sec = median(runs)
    wire_op = Op.ALL_TO_ALL if dt.quantized and op is Op.REDUCE_SCATTER else op
    return {"op": wire_op.value, "levels": list(levels),
            "algo": algo, "comm": comm, "bytes": wire, "seconds": sec,
            "cpu_seconds": sum(cpus) / len(cpus) if cpus else None, "busbw": wire / sec * _bus_factor(op, s)}


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]profile[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), disable=not enabled, transient=False)


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from shardc.dsl import parse_mesh_text

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = parse_mesh_text(args.mesh or _default_mesh_text())
    owned = _init_world(device)
    try:
        _profile(mesh, args, device)
    finally:
        if owned:
            # [Note: teardown] every rank must be done with every group before any rank closes
            # its gloo connections; without this barrier a peer still finishing the last
            # collective sometimes sees the connection drop and aborts ("terminate called").
            dist.barrier()
            dist.destroy_process_group()
    return 0


def _profile(mesh, args, device: str) -> None:
    import torch.distributed as dist

    from shardc.dsl.ir import Collectives, DType
    from shardc.runtime.transport.mesh import ShardMesh

    sm = ShardMesh(mesh, device)
    rank0 = dist.get_rank() == 0
    jobs = _plan(mesh, args)
    runs: dict[int, list[float]] = {j: [] for j in range(len(jobs))}
    cpus: dict[int, list[float]] = {j: [] for j in range(len(jobs))}
    with _progress(rank0) as bar:
        task = bar.add_task("", total=len(jobs) * args.sweeps)
        for sweep in range(args.sweeps):
            for j, (op, levels, algo, size, comm) in enumerate(jobs):
                bar.update(task, description=f"{op.value} over {'+'.join(levels)} ({algo}, {comm}, {size} B)"
                                             + (f", sweep {sweep + 1}/{args.sweeps}" if args.sweeps > 1 else ""))
                s = mesh.factor(levels)
                got, cpu = _time_one(op, sm, levels, Collectives(algo), _numel(size, s), args, device, DType(comm))
                runs[j] += got
                if cpu is not None:
                    cpus[j].append(cpu)
                bar.advance(task)
    entries = [_entry(job, mesh, runs[j], cpus[j]) for j, job in enumerate(jobs)]
    compute = profile_compute.measure(args, device) if args.model else None
    if rank0:
        out = {"mesh": [{"name": l.name, "size": l.size} for l in mesh.levels], "device": device,
               "entries": entries}
        if compute:
            out["compute"] = compute
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.output}: {len(entries)} entries over mesh {mesh}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """`shardc profile` on its own (`torchrun ... -m shardc.cli.cmd_profile -o F.json`):
    the same arguments, exit codes and `error: ...` line as the `shardc` dispatcher."""
    from shardc.dsl.errors import ShardcError

    p = argparse.ArgumentParser(prog="shardc profile", description="measure collective bandwidth (run under torchrun)")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ShardcError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
