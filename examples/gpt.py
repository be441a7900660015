"""A small GPT (the README's main example model).

Token + position embeddings, N pre-norm transformer blocks in the ModuleList
`transformer.h` (the units `units auto` finds), a final LayerNorm and an `lm_head`
tied to the token embedding. Written to trace with torch.fx (no data-dependent
Python control flow in the blocks).

Factories: `tiny()` (tests), `small()` (examples, explain), `gpt(**cfg)`.
`example_inputs()` gives the `shardc compile` CLI a token batch to capture with.
`tensor_parallel(model, tp_mesh)` splits every block's attention (by heads) and MLP over a
tensor-parallel mesh with torch's `parallelize_module` (the torchtitan plan: the first
linear of each Colwise, the last Rowwise).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class GPTConfig:
    vocab_size: int = 256          # byte-level
    block_size: int = 64           # context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
SMALL = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        # no q/k/v bias: the key bias gets an exactly-zero gradient (softmax is shift
        # invariant), which Adam would turn from rounding noise into full-size steps
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.n_head
        # c_attn's rows are head-major (each head's q, k, v together), so a tensor-parallel
        # rank that holds a contiguous block of rows holds whole heads (`tensor_parallel`)
        qkv = self.c_attn(x).view(B, T, -1, 3, hd).transpose(1, 2)     # (B, heads here, T, 3, hd)
        q, k, v = qkv.unbind(3)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = SMALL):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight          # tied
        self.apply(self._init)

    @staticmethod
    def init_module(m):
        """Values for one module of a GPT built on the meta device (`shardc.compile(...,
        init=GPT.init_module)`): its own reset_parameters() (LayerNorm's ones and zeros), then
        GPT's normal(0.02) weights and zero biases."""
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
        GPT._init(m)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt(**cfg) -> GPT:
    return GPT(GPTConfig(**cfg))


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY)


def small() -> GPT:
    torch.manual_seed(0)
    return GPT(SMALL)


def example_inputs(model: GPT | None = None):
    """A token batch for capture: (int64[2, block_size],)."""
    cfg = model.cfg if model is not None else SMALL
    return (torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(0)),)


def tensor_parallel(model: GPT, tp_mesh) -> GPT:
    """Megatron-style TP on every block (torch's `parallelize_module`): c_attn and c_fc
    ColwiseParallel (heads and hidden units split), c_proj RowwiseParallel (its output summed
    over tp). Embeddings, norms and the head stay replicated. `n_head` and 4*n_embd must be
    divisible by the tp size."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    for block in model.transformer.h:
        parallelize_module(block, tp_mesh, plan)
    return model
