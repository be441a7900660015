"""Shared pieces of the runtime tests (no tests here): a tiny tied-embedding model, its
unit list, strategy loading without quantization, and a parity training loop."""
from __future__ import annotations

import copy
import dataclasses
import os

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from shardc.dsl.ir import DType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, D, H, T = 11, 6, 7, 5          # vocab, width, hidden, sequence


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.ln(x))))


class Tiny(nn.Module):
    """Embedding, 3 blocks, optional parameter-free unit, final norm, head tied to the embedding."""

    def __init__(self, n_blocks=3, empty_unit=False, frozen=False, seed=0, d=D, h=H,
                 checkpoint=False):
        super().__init__()
        self.checkpoint = checkpoint
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n_blocks))
        self.mid = nn.Tanh() if empty_unit else None
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(1.5))
        if frozen:
            self.blocks[1].up.requires_grad_(False)

    def forward(self, x):
        h = self.emb(x) * self.scale
        for i, b in enumerate(self.blocks):
            if self.checkpoint:
                h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False)
            else:
                h = b(h)
            if i == 0 and self.mid is not None:
                h = self.mid(h)
        return self.head(self.norm(h))


def units_for(model: Tiny, scopes, bucket: bool = False):
    """Root + one unit per block (+ the parameter-free unit); with `bucket`, blocks 1 and 2
    form one unit of two modules."""
    from shardc.runtime import UnitSpec
    blocks = [f"blocks.{i}" for i in range(len(model.blocks))]
    names = {n for n, _ in model.named_parameters()}
    root = tuple(n for n in names if not n.startswith("blocks."))
    out = [UnitSpec("<root>", tuple(sorted(root)), scopes)]
    for i, b in enumerate(blocks):
        out.append(UnitSpec(b, tuple(n for n, _ in model.named_parameters() if n.startswith(b + ".")),
                            scopes, (b,)))
        if i == 0 and model.mid is not None:
            out.append(UnitSpec("mid", (), scopes, ("mid",)))
    if bucket:
        a, b = out[-2], out[-1]
        out[-2:] = [UnitSpec("bucket", a.params + b.params, scopes, a.modules + b.modules)]
    return out


def strategy(name: str, mesh: str, accumulate: int | None = None, quant: bool = False):
    import shardc
    s = shardc.load_strategy(os.path.join(ROOT, "examples", "strategies", f"{name}.shard"), mesh=mesh)
    if not quant:
        p, g = s.params, s.grads
        sec = p.secondary and dataclasses.replace(p.secondary, quant=None)
        p = dataclasses.replace(p, comm=DType.FP32, secondary=sec)
        g = dataclasses.replace(g, comm=DType.FP32)
        s = dataclasses.replace(s, scopes=dataclasses.replace(s.scopes, params=p, grads=g))
    if accumulate is not None:
        s = dataclasses.replace(s, accumulate=accumulate)
    return s


def batches(steps, world, accumulate, b=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = world * accumulate * b
    return [(torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g))
            for _ in range(steps)]


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def make_opt(kind, params_or_sm, groups=None):
    cls, kw = {"sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
               "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1))}[kind]
    if hasattr(params_or_sm, "optimizer"):
        return params_or_sm.optimizer(cls, param_groups=groups, **kw)
    return cls(params_or_sm, **kw)


def nobias_groups(model):
    return [{"params": [n for n, p in model.named_parameters() if n.endswith("bias")],
             "weight_decay": 0.0}]


def reference(model, data, opt_kind, clip=None, groups=False):
    """Single process on the concatenated batch; returns final params and clip norms."""
    model = copy.deepcopy(model)
    if groups:
        bias = [p for n, p in model.named_parameters() if n.endswith("bias")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("bias") and p.requires_grad]
        opt = make_opt(opt_kind, [{"params": bias, "weight_decay": 0.0}, {"params": rest}])
    else:
        opt = make_opt(opt_kind, [p for p in model.parameters() if p.requires_grad])
    norms = []
    for x, y in data:
        loss_fn(model(x), y).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}, norms


def train_sharded(sm, data, rank, world, accumulate, opt_kind, clip=None, groups=None,
                  use_no_sync=False, before_step=None):
    """`before_step(sm)`, when given, runs after each step's last backward, before clipping
    and opt.step()."""
    opt = make_opt(opt_kind, sm, groups)
    norms = []
    for x, y in data:
        xs, ys = x.chunk(world)[rank].chunk(accumulate), y.chunk(world)[rank].chunk(accumulate)
        for m in range(accumulate):
            if use_no_sync and m < accumulate - 1:
                with sm.no_sync():
                    (loss_fn(sm(xs[m]), ys[m]) / accumulate).backward()
            else:
                (loss_fn(sm(xs[m]), ys[m]) / accumulate).backward()
        if before_step is not None:
            before_step(sm)
        if clip is not None:
            norms.append(float(sm.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
    return sm.full_state_dict(), norms, opt


def max_rel_err(got: dict, want: dict) -> float:
    worst = 0.0
    for k, w in want.items():
        g = got[k]
        worst = max(worst, float((g - w).abs().max() / w.abs().max().clamp_min(1e-12)))
    return worst
