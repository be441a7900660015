"""LLaMA-shaped decoder models for `shardc explain` / `shardc plan` and tests.

Factories (`examples/llama.py:llama_7b` etc.) return an `nn.Module` with the real
LLaMA-1 shapes: token embedding, `layers` (a ModuleList of decoder blocks: RMSNorm,
rotary multi-head attention, RMSNorm, SwiGLU MLP), final RMSNorm, untied output head.
Building under `torch.device("meta")` allocates nothing, so a 30B model is cheap to
describe. `llama_tiny` is small enough for real distributed tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    vocab: int = 32000
    max_seq: int = 2048
    eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x, base: float = 10000.0):
    """Rotary position embedding on (batch, heads, seq, head_dim), computed on the fly."""
    t, d = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Multi-head attention as torchtitan's Llama writes it: q, k, v shaped as `n_heads`
    heads of a fixed `head_dim`, so a tensor-parallel rank holding a block of heads sets
    `n_heads` to its share (the TP recipe's "adjust attention module to use the local
    number of heads"; what `explain --tp` assumes, analysis/costmodel/tp.py)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _build(cfg: LlamaConfig) -> Llama:
    return Llama(cfg)


def llama_7b() -> Llama:
    return _build(LlamaConfig(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008))


def llama_13b() -> Llama:
    return _build(LlamaConfig(dim=5120, n_layers=40, n_heads=40, ffn_dim=13824))


def llama_30b() -> Llama:
    return _build(LlamaConfig(dim=6656, n_layers=60, n_heads=52, ffn_dim=17920))


def llama_tiny() -> Llama:
    """Two blocks with sizes no mesh divides (root 3654, block 3330 elements): shards need padding."""
    return _build(LlamaConfig(dim=18, n_layers=2, n_heads=3, ffn_dim=37, vocab=101, max_seq=32))


def llama_logits() -> Llama:
    """A small Llama whose loss dominates its peak (vocab 4096 over dim 64, two blocks): the
    loss's tensors in explain's timeline (tests/test_peak_loss.py)."""
    return _build(LlamaConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab=4096, max_seq=512))


def llama_65b() -> Llama:
    return _build(LlamaConfig(dim=8192, n_layers=80, n_heads=64, ffn_dim=22016))


def llama_65b_2l() -> Llama:
    """LLaMA-65B's width with two blocks: the suite's simulated rank (tests/test_simulate.py)."""
    return _build(LlamaConfig(dim=8192, n_layers=2, n_heads=64, ffn_dim=22016))
