"""World size 1: a compiled model's step time against eager PyTorch (information only).

    python bench/overhead.py [--model mlp|gpt|both] [--steps 20] [--repeat 3] [--profile]

One process, a gloo process group of world size 1, the zero3 strategy with its mesh
overridden to `gpu(1)`: nothing is communicated, so the ratio compiled/eager is the
runtime's own overhead (gathers and reduce-scatters degenerate to copies or nothing,
the engine's hooks, views and bookkeeping). Models: a 17 M-parameter MLP tower
(8 blocks of LayerNorm + Linear(512, 2048) + GELU + Linear(2048, 512), batch 64 x 512
features) and examples/gpt.py's `small` config (batch 8). A step is forward, backward,
AdamW step, zero_grad. Prints, per model, the median step time of each of `--repeat`
runs of `--steps` steps (after 3 warm-up steps), the median of those medians and the
ratio; `--profile` adds torch.profiler's top CPU ops of one compiled step and one eager
step. Report the load average with the numbers: the machine may be shared.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class Tower(nn.Module):
    """17 M parameters: 8 x (LayerNorm(512), Linear(512, 2048), GELU, Linear(2048, 512))."""
    def __init__(self, d=512, n=8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _mlp():
    torch.manual_seed(0)
    model = Tower()
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    return model, (x,), lambda out: out.pow(2).mean()


def _gpt():
    from examples.gpt import SMALL, GPT
    torch.manual_seed(0)
    model = GPT(SMALL)
    x = torch.randint(0, SMALL.vocab_size, (8, SMALL.block_size), generator=torch.Generator().manual_seed(1))
    return model, (x,), lambda out: F.cross_entropy(out.flatten(0, 1), x.flatten())


MODELS = {"mlp": _mlp, "gpt": _gpt}


def _build(kind: str, compiled: bool):
    import shardc
    model, inputs, loss_fn = MODELS[kind]()
    if compiled:
        strategy = os.path.join(ROOT, "examples", "strategies", "zero3.shard")
        model = shardc.compile(model, strategy, example_inputs=inputs, mesh="gpu(1)")
        opt = model.optimizer(torch.optim.AdamW, lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, inputs, loss_fn, opt


def _step(model, inputs, loss_fn, opt):
    loss_fn(model(*inputs)).backward()
    opt.step()
    opt.zero_grad()


def _median_step(built, steps: int) -> float:
    for _ in range(3):
        _step(*built)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _step(*built)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _profile(built, label: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        _step(*built)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            _step(*built)
    print(f"\n--- {label}: top {rows} CPU ops by self time, 3 steps ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("mlp", "gpt", "both"), default="both")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("gloo", rank=0, world_size=1)
    kinds = ("mlp", "gpt") if args.model == "both" else (args.model,)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for kind in kinds:
        eager, comp = _build(kind, False), _build(kind, True)
        n = sum(p.numel() for p in MODELS[kind]()[0].parameters())
        e_runs, c_runs = [], []
        for _ in range(args.repeat):          # interleaved, so load drifts hit both alike
            e_runs.append(_median_step(eager, args.steps))
            c_runs.append(_median_step(comp, args.steps))
        e, c = statistics.median(e_runs), statistics.median(c_runs)
        print(f"{kind}: {n / 1e6:.1f} M params; eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms, "
              f"ratio {c / e:.3f}  (runs eager {[round(x * 1e3, 1) for x in e_runs]}, "
              f"compiled {[round(x * 1e3, 1) for x in c_runs]})", flush=True)
        if args.profile:
            _profile(comp, f"{kind} compiled", 15)
            _profile(eager, f"{kind} eager", 10)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
