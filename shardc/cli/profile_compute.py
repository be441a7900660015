"""`shardc profile --model PATH:FACTORY` — the achievable compute rate, measured.

Input: a running world, a model factory, the micro-batch shape (`--tokens`, `--seq`)
and the device. Output: the profile's `"compute"` record, read by the cost model
(`analysis/costmodel/profile.py`, `Profile.flops`) when `--tflops` is not given:

    {"model", "tokens", "seq", "dtype", "flops", "seconds", "cpu_seconds", "flops_per_s"}

[Note: measured compute rate]
Every rank builds the model on the device and runs forward, a summed loss and backward
of one micro-batch `--compute-iters` times after `--warmup` runs, all ranks at the same time
(barrier before): on a shared machine (8 CPU ranks on 2 cores, or GPUs sharing host
threads) the rate each rank achieves is the contended one training sees. `flops` are
the executed FLOPs the cost model counts for that micro-batch (`flops.trace` on the
meta device, fp32), so `flops / flops_per_s` gives back the measured seconds exactly;
`seconds` is the mean over ranks of the mean per run; `cpu_seconds` the process CPU
time per run, mean over ranks (CPU only; with `seconds` it says how many ranks share
a core, [Note: CPU share of a collective] in profile.py).
"""
from __future__ import annotations

import time

from shardc.cli.argtypes import positive_int


def add_arguments(p) -> None:
    g = p.add_argument_group("compute rate (optional)")
    g.add_argument("--model", metavar="PATH:FACTORY",
                   help="also time this model's forward+backward on every rank at once: the achievable FLOP/s")
    g.add_argument("--tokens", type=int, default=4096, help="tokens per rank per micro-batch (default 4096)")
    g.add_argument("--seq", type=int, help="sequence length (default: --tokens, one sequence)")
    g.add_argument("--compute-iters", type=positive_int, default=10,
                   help="timed forward+backward runs (default 10: one run's time drifts by ±10 %% on a shared machine)")


def measure(args, device: str) -> dict:
    """The `"compute"` record; see [Note: measured compute rate]."""
    import torch
    import torch.distributed as dist

    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.analysis.costmodel.flops import sample_input, trace
    from shardc.cli.loader import build_model
    from shardc.dsl import load_strategy
    from shardc.dsl.errors import ShardcError
    from shardc.units import find_units

    seq = args.seq or args.tokens
    if args.tokens < 1 or seq < 1 or args.tokens % seq:
        raise ShardcError(f"--tokens {args.tokens} must be a whole number of --seq {seq} sequences")
    batch = args.tokens // seq
    meta = build_model(args.model, device="meta")
    one = load_strategy("mesh gpu(1)\nparams replicate\n")
    units = find_units(meta, resolve_bucket(meta, one))   # the total does not depend on them
    flops = trace(meta, units, batch=batch, seq=seq, dtype="fp32").executed_flops()
    model = build_model(args.model, device=device)
    x = torch.zeros_like(sample_input(meta, batch, seq), device=device)

    def once():
        out = model(x)
        (out if torch.is_tensor(out) else out[0]).float().sum().backward()
        model.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        once()
    _sync(device)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.compute_iters):
        once()
    _sync(device)
    mine = torch.tensor([(time.perf_counter() - t0) / args.compute_iters,
                         (time.process_time() - c0) / args.compute_iters],
                        dtype=torch.float64, device=device)
    dist.all_reduce(mine)
    sec, cpu = (mine / dist.get_world_size()).tolist()
    return {"model": args.model, "tokens": args.tokens, "seq": seq, "dtype": "fp32", "flops": flops,
            "seconds": sec, "cpu_seconds": cpu if device == "cpu" else None, "flops_per_s": flops / sec}


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()
