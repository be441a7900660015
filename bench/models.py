"""Benchmark models and data (bench stage: model name -> nn.Module, seeded batches).

Input: `--model NAME`, either a preset below (built with `examples/gpt.py`'s `gpt(**cfg)`,
the same model shardc's examples and tests use) or `PATH.py:FACTORY`. Output: the
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
}
SEED = 1234


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
        return _load_attr("examples/gpt.py:gpt")(**PRESETS[name])
    if ":" in name:
        return _load_attr(name)()
    raise ValueError(f"unknown model {name!r}: use one of {sorted(PRESETS)} or PATH.py:FACTORY")


def bench() -> nn.Module:
    """The `bench` preset as a factory, for `shardc explain/profile --model bench/models.py:bench`."""
    return build_model("bench")


def model_dims(model: nn.Module) -> tuple[int, int]:
    """(vocab_size, context length) of a GPT-like model."""
    cfg = model.cfg
    return cfg.vocab_size, cfg.block_size


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
