"""`shardc.compile` time against model depth (information only, no asserts).

    python bench/compile_time.py [--depths 2 16 32 64] [--repeat 3] [--strategy zero3.shard]
    python bench/compile_time.py --first-step [--depths 2 8 16] [--backends eager,inductor] [--json OUT]

One process, a gloo process group of world size 1 (the strategy's mesh is overridden to
`gpu(1)`: what is timed is the compiler, not communication). Models are built from
configs with random weights (nothing is downloaded): Hugging Face Llama with
2/16/32/64 layers and a tiny hidden size (64, 4 heads), and GPT-2 small's shape (12 layers,
768 wide, 124 M parameters). Export capture (what Hugging Face models take). Per model it
prints the median of `--repeat` runs of each stage and of the whole `shardc.compile`:

- `capture+passes+emit`: `compile_source` (unit finding, torch.export, the graph
  passes, lowering, codegen),
- `shard_model`: loading the emitted module and sharding the model (flat groups),

and the seconds per layer, to show whether growth is linear in depth.

`--first-step`: what a backend costs before training runs at speed. Per depth and backend
(`eager`: the runtime, `inductor`: the whole-step compiled mode, where dynamo and Inductor
compile in the first step), `--repeat` fresh processes (`--first-step-one`), each with an
empty TORCHINDUCTOR_CACHE_DIR, time `shardc.compile`, the first training step (forward,
cross-entropy, backward, AdamW `opt.step()`, `zero_grad()`; batch 2 x 16 tokens) and the
median of the 5 steps after it. The Llama is built with `use_cache=False` (a KV cache's
updates are not a training forward, and the whole-step mode refuses them). Prints the
medians over the processes; a process's own start-up (Python, importing torch) is not
counted, Inductor's first-use start-up is (a training run pays it once).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def llama(layers: int, use_cache: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, use_cache=use_cache))


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config())          # 12 layers, 768 wide, 12 heads: GPT-2 small


def time_one(factory, strategy: str, repeat: int) -> dict:
    from shardc.api import load_emitted
    from shardc.compiler.api import compile_source
    src_t, shard_t = [], []
    for _ in range(repeat):
        torch.manual_seed(0)
        model = factory()
        x = torch.randint(0, 256, (2, 16))
        t0 = time.perf_counter()
        source, plan = compile_source(model, strategy, example_inputs=(x,), mesh="gpu(1)")
        t1 = time.perf_counter()
        load_emitted(source, plan.strategy.name)["shard_model"](model)
        t2 = time.perf_counter()
        src_t.append(t1 - t0)
        shard_t.append(t2 - t1)
    return dict(units=len(plan.units), capture=plan.capture, source=statistics.median(src_t),
                shard=statistics.median(shard_t), total=statistics.median(a + b for a, b in zip(src_t, shard_t)))


def first_step_one(depth: int, backend: str, strategy: str) -> dict:
    """In this (fresh) process: shardc.compile, the first training step, the 5 after it."""
    import torch.nn.functional as F

    import shardc
    torch.manual_seed(0)
    model = llama(depth, use_cache=False)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    sm = shardc.compile(model, strategy, example_inputs=(x,), mesh="gpu(1)", backend=backend)
    compile_s = time.perf_counter() - t0
    opt = sm.optimizer(torch.optim.AdamW, lr=1e-4)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        logits = sm(x).logits
        F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return {"depth": depth, "backend": backend, "compile_s": compile_s, "first_step_s": times[0],
            "later_step_s": statistics.median(times[1:])}


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def first_step(args) -> int:
    """--first-step: one fresh process per (depth, backend, repeat)."""
    backends = args.backends.split(",")
    load = [os.getloadavg()]
    print(f"strategy {args.strategy}, HF Llama hidden 64 (use_cache=False), median of {args.repeat} fresh processes; "
          f"load average {' '.join(f'{x:.2f}' for x in load[0])}")
    print("| layers | backend | shardc.compile (s) | first step (s) | later step (ms) | first step - later step (s) |")
    print("|---|---|---|---|---|---|")
    rows = []
    for depth in args.depths:
        for backend in backends:
            runs = []
            for _ in range(args.repeat):
                with tempfile.TemporaryDirectory(prefix="compile-time-inductor-") as cache:
                    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, MASTER_PORT=str(_free_port()))
                    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--first-step-one", str(depth),
                                        backend, "--strategy", args.strategy], env=env, capture_output=True,
                                       text=True, timeout=args.timeout)
                if p.returncode != 0:
                    print(f"| {depth} | {backend} | failed: {(p.stderr.strip().splitlines() or ['?'])[-1]} |||| ",
                          flush=True)
                    break
                runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
            if not runs:
                rows.append({"depth": depth, "backend": backend, "error": p.stderr[-2000:]})
                continue
            med = {k: statistics.median(r[k] for r in runs) for k in ("compile_s", "first_step_s", "later_step_s")}
            rows.append({"depth": depth, "backend": backend, **med, "runs": runs})
            print(f"| {depth} | {backend} | {med['compile_s']:.2f} | {med['first_step_s']:.2f} | "
                  f"{med['later_step_s'] * 1e3:.1f} | {med['first_step_s'] - med['later_step_s']:.2f} |", flush=True)
            load.append(os.getloadavg())
    print(f"load average after: {' '.join(f'{x:.2f}' for x in load[-1])}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": {"strategy": args.strategy, "repeat": args.repeat, "depths": args.depths,
                                  "backends": backends, "torch": torch.__version__, "cpu_count": os.cpu_count(),
                                  "started_utc": args.started, "load_average": [list(x) for x in load]},
                       "first_step": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs="+", default=None, help="default: 2 16 32 64 (--first-step: 2 8 16)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--strategy", default="zero3.shard", help="a file in examples/strategies/")
    ap.add_argument("--no-gpt2", action="store_true", help="skip the GPT-2 small shape")
    ap.add_argument("--first-step", action="store_true",
                    help="time shardc.compile and the first training step per backend (fresh processes)")
    ap.add_argument("--backends", default="eager,inductor", help="--first-step: comma-separated, eager|inductor")
    ap.add_argument("--timeout", type=float, default=900, help="--first-step: seconds per process")
    ap.add_argument("--json", dest="json_out", default=None, help="--first-step: write every figure here")
    ap.add_argument("--first-step-one", nargs=2, metavar=("DEPTH", "BACKEND"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    strategy = os.path.join(ROOT, "examples", "strategies", args.strategy)
    if args.first_step:
        args.depths = args.depths or [2, 8, 16]
        bad = [b for b in args.backends.split(",") if b not in ("eager", "inductor")]
        if bad:
            ap.error(f"--backends: {', '.join(bad)}; use eager, inductor")
        return first_step(args)
    if args.first_step_one:
        torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    if args.first_step_one:
        r = first_step_one(int(args.first_step_one[0]), args.first_step_one[1], strategy)
        dist.destroy_process_group()
        print(json.dumps(r))
        return 0
    args.depths = args.depths or [2, 16, 32, 64]
    cases = [(f"llama-{d}L (hidden 64)", d, lambda d=d: llama(d)) for d in args.depths]
    if not args.no_gpt2:
        cases.append(("gpt2-small (12L, 768)", 12, gpt2_small))
    load = os.getloadavg()
    print(f"strategy {args.strategy}, median of {args.repeat}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"| model | layers | units | capture | capture+passes+emit (s) | shard_model (s) | "
          f"shardc.compile (s) | s per layer |")
    print("|---|---|---|---|---|---|---|---|")
    for name, depth, factory in cases:
        r = time_one(factory, strategy, args.repeat)
        print(f"| {name} | {depth} | {r['units']} | {r['capture']} | {r['source']:.2f} | {r['shard']:.2f} | "
              f"{r['total']:.2f} | {r['total'] / depth:.3f} |", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
