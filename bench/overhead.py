"""World size 1: a compiled model's step time against eager PyTorch (information only).

    python bench/overhead.py [--model mlp|gpt|both] [--steps 20] [--repeat 3] [--profile]
                             [--modes eager,shardc] [--json OUT.json]

One process, a gloo process group of world size 1, the zero3 strategy with its mesh
overridden to `gpu(1)`: nothing is communicated, so the ratio compiled/eager is the
runtime's own overhead (gathers and reduce-scatters degenerate to copies or nothing,
the engine's hooks, views and bookkeeping). Models: a 17 M-parameter MLP tower
(8 blocks of LayerNorm + Linear(512, 2048) + GELU + Linear(2048, 512), batch 64 x 512
features) and examples/gpt.py's `small` config (batch 8). A step is forward, backward,
AdamW step, zero_grad. `--modes` picks what runs (each built once, from the same weights):

- `eager`: the plain model, `torch.optim.AdamW`;
- `compile`: `torch.compile(model)` (no shardc), `torch.optim.AdamW`;
- `shardc`: `shardc.compile(model, zero3)`, the eager runtime (the "compiled" of the
  default `eager,shardc` run, the runtime's own overhead);
- `shardc+compile`: `torch.compile` of that ShardedModule (the collectives break the
  graph at unit boundaries, docs/compiler.md "torch.compile");
- `shardc+inductor`: `shardc.compile(model, zero3, backend="inductor")`, the whole-step
  compiled mode (each micro-batch's forward and backward one Inductor graph, the step
  boundary another).

Prints, per model, the median step time of each of `--repeat` runs of `--steps` steps
(after 3 warm-up steps; the modes interleaved run by run, so load drifts hit all alike),
the median of those medians, its ratio to `eager` (and to `compile` when both ran), and
the first step's time (where dynamo and Inductor compile; every mode's first step is
taken before any run, in `--modes` order, after one throwaway compile of a tiny function
that pays the compiler's one-time start-up). The compiled modes share one process and
Inductor's in-memory caches, so a later mode's first step may reuse a kernel an earlier
one compiled; the on-disk caches start empty (a fresh TORCHINDUCTOR_CACHE_DIR unless one
is set). `bench/compile_time.py --first-step` measures the first step cleanly, one fresh
process per figure. Dynamo graphs compiled during the timed steps (recompilations) are counted and
printed: 0 means every timed step ran the warm-up's graphs. `--profile` adds
torch.profiler's top CPU ops of one step of every mode. `--json` writes every figure.
Report the load average with the numbers: the machine may be shared.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
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


MODES = ("eager", "compile", "shardc", "shardc+compile", "shardc+inductor")


def _build(kind: str, mode: str):
    import shardc
    model, inputs, loss_fn = MODELS[kind]()
    if mode.startswith("shardc"):
        strategy = os.path.join(ROOT, "examples", "strategies", "zero3.shard")
        backend = "inductor" if mode == "shardc+inductor" else "eager"
        model = shardc.compile(model, strategy, example_inputs=inputs, mesh="gpu(1)", backend=backend)
        opt = model.optimizer(torch.optim.AdamW, lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if mode in ("compile", "shardc+compile"):
        model = torch.compile(model)
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


def _graphs() -> int:
    """Dynamo graphs compiled so far in this process."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _ms(x: float) -> float:
    return round(x * 1e3, 1)


def _warm_compiler() -> None:
    """One throwaway compile of a tiny function: dynamo's and Inductor's one-time start-up
    (imports, the compile workers) then falls on no mode's first step."""
    x = torch.ones(4, requires_grad=True)
    torch.compile(lambda t: (t * 2).sin().sum())(x).backward()


def run_model(kind: str, modes: list[str], args) -> dict:
    n = sum(p.numel() for p in MODELS[kind]()[0].parameters())
    if any(m != "eager" and m != "shardc" for m in modes):
        _warm_compiler()
    built, first = {}, {}
    for mode in modes:                  # build and take each mode's first step (its compile)
        built[mode] = _build(kind, mode)
        t0 = time.perf_counter()
        _step(*built[mode])
        first[mode] = time.perf_counter() - t0
    runs = {m: [] for m in modes}
    recompiled = {m: 0 for m in modes}
    for _ in range(args.repeat):        # interleaved, so load drifts hit every mode alike
        for mode in modes:
            g = _graphs()
            runs[mode].append(_median_step(built[mode], args.steps))
            recompiled[mode] += _graphs() - g
    med = {m: statistics.median(r) for m, r in runs.items()}
    print(f"{kind}: {n / 1e6:.1f} M params, median of {args.repeat} runs of {args.steps} steps")
    print("| mode | step (ms) | vs eager | vs compile | first step (s) | runs (ms) | graphs compiled in the runs |")
    print("|---|---|---|---|---|---|---|")
    for m in modes:
        ve = f"{med[m] / med['eager']:.3f}" if "eager" in med else "-"
        vc = f"{med[m] / med['compile']:.3f}" if "compile" in med else "-"
        print(f"| {m} | {med[m] * 1e3:.1f} | {ve} | {vc} | {first[m]:.2f} | "
              f"{', '.join(str(_ms(x)) for x in runs[m])} | {recompiled[m]} |", flush=True)
    if args.profile:
        for m in modes:
            _profile(built[m], f"{kind} {m}", 15 if m != "eager" else 10)
    return {"params": n, "modes": {m: {"step_s": med[m], "runs_s": runs[m], "first_step_s": first[m],
                                       "graphs_compiled_in_runs": recompiled[m]} for m in modes}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("mlp", "gpt", "both"), default="both")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--modes", default="eager,shardc", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", dest="json_out", default=None, help="write every figure here")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or len(set(modes)) != len(modes):
        ap.error(f"--modes: {', '.join(bad) or 'a mode twice'}; use {', '.join(MODES)}")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="overhead-inductor-"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("gloo", rank=0, world_size=1)
    kinds = ("mlp", "gpt") if args.model == "both" else (args.model,)
    load = [os.getloadavg()]
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load[0])}")
    doc = {"config": {"steps": args.steps, "repeat": args.repeat, "threads": args.threads, "modes": modes,
                      "torch": torch.__version__, "cpu_count": os.cpu_count(),
                      "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, "models": {}}
    for kind in kinds:
        doc["models"][kind] = run_model(kind, modes, args)
        load.append(os.getloadavg())
    print(f"load average after: {' '.join(f'{x:.2f}' for x in load[-1])}")
    doc["config"]["load_average"] = [list(x) for x in load]
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
