"""`shardc.compile` time against model depth (information only, no asserts).

    python bench/compile_time.py [--depths 2 16 32 64] [--repeat 3] [--strategy zero3.shard]

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
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64))


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 16, 32, 64])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--strategy", default="zero3.shard", help="a file in examples/strategies/")
    ap.add_argument("--no-gpt2", action="store_true", help="skip the GPT-2 small shape")
    args = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    strategy = os.path.join(ROOT, "examples", "strategies", args.strategy)
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
