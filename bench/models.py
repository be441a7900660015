"""Benchmark models and data (bench stage: model name -> nn.Module, seeded batches).

Input: `--model NAME`, either a preset below (built with `examples/gpt.py`'s `gpt(**cfg)`,
the same model shardc's examples and tests use; `moe` with `examples/moe.py`'s `moe(**cfg)`,
[Note: the moe preset]) or `PATH.py:FACTORY`. Output: the
model (built under a fixed seed, so every system starts from identical weights) and
a deterministic token stream: batch (step, micro, rank) is the same for every system.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> gpt() config. "bench" is the default (see docs/BENCHMARKS.md for why).
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32),
    "small": dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),
    "medium": dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256),
    "bench": dict(vocab_size=256, block_size=64, n_layer=4, n_head=8, n_embd=512),
    "moe": dict(vocab=256, dim=128, n_layers=4, n_heads=4, n_experts=8, top_k=2, expert_dim=256),
}
FACTORIES = {"moe": "examples/moe.py:moe"}      # a preset not listed here is a gpt() config
SEED = 1234
MOE_CONTEXT = 64

# [Note: the moe preset]
# `moe`: examples/moe.py's MoE decoder (the expert-parallel tests' model) with 4 blocks of
# d=128, 4 heads, 8 SwiGLU experts of hidden 256 each, top-2 routing, vocab 256, untied head:
# 3.48 M parameters, 90% of them experts (4 x 786,432). It has no position embeddings, so it
# takes any context; the benchmark feeds it MOE_CONTEXT = 64 tokens, as the GPT presets.
# Sized like `medium` (3.24 M) so a step takes 1-4 s on 8 ranks of this machine; its
# experts are `layers.N.moe.experts` (the shipped examples/strategies/moe files' "*.experts").


def _load_attr(spec: str):
    path, _, attr = spec.rpartition(":")
    if path.endswith(".py"):
        full = path if os.path.isabs(path) else os.path.join(ROOT, path)
        mspec = importlib.util.spec_from_file_location("_bench_model_" + os.path.basename(full)[:-3], full)
        mod = importlib.util.module_from_spec(mspec)
        sys.modules[mspec.name] = mod          # dataclasses look the module up
        mspec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(path)
    return getattr(mod, attr)


def build_model(name: str) -> nn.Module:
    """The model for `name`, with weights fixed by SEED (identical on every rank)."""
    torch.manual_seed(SEED)
    if name in PRESETS:
        return _load_attr(FACTORIES.get(name, "examples/gpt.py:gpt"))(**PRESETS[name])
    if ":" in name:
        return _load_attr(name)()
    raise ValueError(f"unknown model {name!r}: use one of {sorted(PRESETS)} or PATH.py:FACTORY")


def bench() -> nn.Module:
    """The `bench` preset as a factory, for `shardc explain/profile --model bench/models.py:bench`."""
    return build_model("bench")


def model_dims(model: nn.Module) -> tuple[int, int]:
    """(vocab_size, context length) of a GPT-like model (examples/moe.py's MoE: its vocab and
    MOE_CONTEXT, [Note: the moe preset])."""
    cfg = model.cfg
    if hasattr(cfg, "vocab_size"):
        return cfg.vocab_size, cfg.block_size
    return cfg.vocab, MOE_CONTEXT


def batch(model: nn.Module, step: int, micro: int, rank: int, micro_batch: int):
    """Tokens and next-token targets for (step, micro, rank); same for every system."""
    vocab, T = model_dims(model)
    g = torch.Generator().manual_seed(SEED + 1_000_003 * step + 1009 * micro + rank)
    toks = torch.randint(0, vocab, (micro_batch, T + 1), generator=g)
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def block_list(model: nn.Module) -> nn.ModuleList | None:
    """The largest ModuleList: the repeated blocks (None if the model has none)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len) if lists else None


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (children of the largest ModuleList): FSDP2's wrap units."""
    blocks = block_list(model)
    return [] if blocks is None else list(blocks)


def n_params(model: nn.Module) -> int:
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


if __name__ == "__main__":      # print the presets' sizes
    for k in PRESETS:
        m = build_model(k)
        root = n_params(m) - sum(n_params(b) for b in block_modules(m))
        print(f"{k:6s} params={n_params(m):>10,d} root={root:,d}", file=sys.stdout)
