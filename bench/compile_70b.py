"""`shardc.compile` CPU time of an HF Llama of Llama-2-70B's shape as one simulated rank
(issue 50) — stage: benchmark (information only).

Input: `LlamaForCausalLM` built on meta (vocab 32000, hidden 8192, intermediate 28672, 80
layers, 64 heads, 8 KV heads), ZeRO-3 on `node(64) > gpu(8)`, rank 315 of 512 on torch's
fake process group inside `runtime.simulation` (docs/simulate.md). Output: the CPU seconds
(`time.process_time`) of `shardc.compile` and its phases' wall seconds. `PROF=1` prints a
cProfile (`SORT=tottime`, `N=` rows, `CALLERS=` a function's callers). Usage:
    python bench/compile_70b.py
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STRATEGY = """strategy z
mesh node(64) > gpu(8)
params shard over world
grads  shard over world
optim  shard over world
"""


def main() -> None:
    import shardc
    from shardc.runtime import simulation
    from shardc.simulate import init_fake
    from transformers import LlamaConfig, LlamaForCausalLM
    init_fake(315, 512)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    x = torch.zeros(1, 16, dtype=torch.long, device="meta")
    prof = None
    if os.environ.get("PROF"):
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t0 = time.process_time()
    with simulation.simulation():
        sm = shardc.compile(model, STRATEGY, example_inputs=(x,))
    cpu = time.process_time() - t0
    if prof is not None:
        import pstats
        prof.disable()
        stats = pstats.Stats(prof).sort_stats(os.environ.get("SORT", "cumulative"))
        stats.print_stats(int(os.environ.get("N", "45")))
        if os.environ.get("CALLERS"):
            stats.print_callers(os.environ["CALLERS"])
    phases = ", ".join(f"{k} {v:.2f}" for k, v in sm.startup_seconds.items())
    print(f"shardc.compile: {cpu:.2f} CPU s (wall per phase: {phases})")


if __name__ == "__main__":
    main()
