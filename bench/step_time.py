"""Step time per named strategy on CPU gloo ranks (information only, no asserts).

    python bench/step_time.py [--mesh "node(2) > gpu(2)"] [--steps 5] [--width 128] [--only zero3 ...]
                              [--profile]

Spawns one process per rank (torch.multiprocessing, gloo on loopback), shards a small
GPT-like stack with each strategy in examples/strategies/ (as written, quantization
included; zero_topo only when the mesh has three levels) and prints the median time of
an optimizer step (accumulate micro-batches + clip + AdamW) and the per-rank model-state
memory from memory_report(). `--profile`: rank 0 runs its timed steps under
torch.profiler and prints the top CPU ops by self time per strategy.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["ddp", "zero1", "zero2", "zero3", "mics", "hsdp_zero2", "zeropp", "paro_igg",
         "paro_iig", "paro_nig", "lins_7b", "zero_topo"]
VOCAB = 256


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Model(nn.Module):
    def __init__(self, d, n_blocks=4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def units(model, scopes):
    from shardc.runtime import UnitSpec
    names = [n for n, _ in model.named_parameters()]
    out = [UnitSpec("<root>", tuple(n for n in names if not n.startswith("blocks.")), scopes)]
    for i in range(len(model.blocks)):
        pre = f"blocks.{i}."
        out.append(UnitSpec(f"blocks.{i}", tuple(n for n in names if n.startswith(pre)), scopes,
                            (f"blocks.{i}",)))
    return out


def run_one(name, mesh, args, rank, world):
    import shardc
    from shardc.runtime import shard_module
    path = os.path.join(ROOT, "examples", "strategies", f"{name}.shard")
    s = shardc.load_strategy(path, mesh=mesh)
    s = dataclasses.replace(s, accumulate=args.accumulate)
    torch.manual_seed(0)
    model = Model(args.width)
    sm = shard_module(model, s, units(model, s.scopes))
    opt = sm.optimizer(torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    times = []
    prof = _profiler(args.profile and rank == 0)
    for step in range(args.steps + 1):
        if step == 1:
            prof.__enter__()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.accumulate):
            x = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
            loss = F.cross_entropy(sm(x).flatten(0, 1), x.flatten()) / args.accumulate
            loss.backward()
        sm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step:                       # the first step warms up
            times.append(time.perf_counter() - t0)
    prof.__exit__(None, None, None)
    if args.profile and rank == 0:
        print(f"--- {name}: top CPU ops by self time, {args.steps} steps (rank 0) ---")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
    return statistics.median(times), sm.memory_report()["total"]


def _profiler(on: bool):
    if not on:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU])


def worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    levels = args.mesh.count(">") + 1
    for name in NAMES:
        if (name == "zero_topo") != (levels == 3) or (args.only and name not in args.only):
            continue
        t, mem = run_one(name, args.mesh, args, rank, world)
        if rank == 0:
            print(f"{name:12s} {t * 1e3:9.1f} ms/step   {mem / 1024:9.1f} KiB model states/rank",
                  flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="node(2) > gpu(2)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--only", nargs="*", help="strategy names (default: all that fit the mesh)")
    ap.add_argument("--profile", action="store_true", help="rank 0: torch.profiler's top ops per strategy")
    args = ap.parse_args(argv)
    world = 1
    for part in args.mesh.split(">"):
        world *= int(part.strip().split("(")[1].rstrip(")"))
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    print(f"mesh {args.mesh} ({world} gloo ranks), width {args.width}, accumulate "
          f"{args.accumulate}, median of {args.steps} steps")
    mp.spawn(worker, args=(world, port, args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
