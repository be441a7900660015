"""Sharded optimizer — stage: runtime.

Input: the engine's trainable flat groups, a torch.optim class, per-name param groups.
Output: a plain `torch.optim.Optimizer` instance over this rank's optimizer shard:
one parameter per (original parameter ∩ this rank's OS chunk) plus one padding piece,
each an `nn.Parameter` view of the fp32 master whose `.grad` is a view of the grad
shard. Step hooks wait for the gradient sync before the update and run the update
re-gather after it; `zero_grad` zeroes the grad shards in place (the views stay).

[Note: element-wise only]
Sharding optimizer state is exact only for updates that act element by element (each
element's new value depends on its own grad and state). LBFGS, Adafactor-style factored
moments and anything not in `ELEMENTWISE` are refused unless every unit's optim scope
is `replicate` (s_OS = 1), where each piece is a whole parameter.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import nn

from .errors import RuntimeUsageError

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.ASGD, torch.optim.Rprop, torch.optim.Adadelta)


@dataclass(frozen=True, slots=True)
class Piece:
    name: str          # original parameter FQN, or "<padding>:<unit>"
    unit: int
    start: int         # element range in the unit's full flat buffer
    stop: int


def _pieces(unit: int, group) -> list[tuple[Piece, int, int]]:
    """(piece, lo, hi) with lo/hi relative to the OS chunk."""
    a, b = group.os_start, group.os_start + group.os_len
    out = []
    for s in group.layout.slots:
        lo, hi = max(a, s.offset), min(b, s.offset + s.numel)
        if lo < hi:
            out.append((Piece(s.fqn, unit, lo, hi), lo - a, hi - a))
    lo, hi = max(a, group.layout.phi), b
    if lo < hi:
        out.append((Piece(f"<padding>:{unit}", unit, lo, hi), lo - a, hi - a))
    return out


def _check_cls(cls, engine) -> None:
    if cls in ELEMENTWISE:
        return
    sharded = any(g.s_os > 1 for g in engine.trainable_groups())
    if sharded:
        raise RuntimeUsageError(
            f"{getattr(cls, '__name__', cls)} is not an element-wise optimizer, so it cannot "
            f"run on sharded optimizer states; use one of "
            f"{', '.join(c.__name__ for c in ELEMENTWISE)} or 'optim replicate'")


def build_optimizer(engine, aliases: dict[str, str], frozen: set[str], cls,
                    param_groups=None, **kw) -> torch.optim.Optimizer:
    _check_cls(cls, engine)
    wanted: dict[str, int] = {}
    for gi, pg in enumerate(param_groups or []):
        if "params" not in pg:
            raise RuntimeUsageError(f"param group {gi} has no 'params' list of parameter names")
        for name in pg["params"]:
            if not isinstance(name, str):
                raise RuntimeUsageError(
                    f"param group {gi}: 'params' must list parameter names, got {type(name).__name__}")
            canon = aliases.get(name)
            if canon is None:
                hint = " (it is frozen)" if name in frozen else ""
                raise RuntimeUsageError(f"param group {gi}: no trainable parameter named {name!r}{hint}")
            if canon in wanted and wanted[canon] != gi:
                raise RuntimeUsageError(f"parameter {name!r} is listed in two param groups")
            wanted[canon] = gi
    groups = [dict(pg, params=[]) for pg in (param_groups or [])]
    default = {"params": []}
    pieces: list[Piece] = []
    ordered: list[nn.Parameter] = []
    for ui, g in [(u.index, u.trainable) for u in engine.units if u.trainable is not None]:
        for piece, lo, hi in _pieces(ui, g):
            p = nn.Parameter(g.master[lo:hi])
            p.grad = g.os_grad[lo:hi] if g.gdtype == torch.float32 else None
            target = groups[wanted[piece.name]] if piece.name in wanted else default
            target["params"].append(p)
            pieces.append(piece)
            ordered.append(p)
    opt = cls(groups + [default], **kw)
    _attach(opt, engine, pieces, ordered)
    return opt


def _attach(opt, engine, pieces, params) -> None:
    grad_views = {id(p): p.grad for p in params}
    fp32_grads = any(g.gdtype != torch.float32 for g in engine.trainable_groups())

    def pre(optimizer, args, kwargs):
        engine.wait_sync("opt.step()")
        if fp32_grads:
            _cast_grads(params, engine)
        for p in params:               # zero_grad(set_to_none) may have dropped the views
            if p.grad is None and grad_views[id(p)] is not None:
                p.grad = grad_views[id(p)]

    def post(optimizer, args, kwargs):
        engine.after_step()

    def zero_grad(self, set_to_none: bool = True):
        engine.zero_grad()
        for p in params:               # drop transient fp32 copies (low-precision grads)
            if grad_views[id(p)] is None:
                p.grad = None

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    opt.zero_grad = types.MethodType(zero_grad, opt)
    opt.shardc_pieces = pieces
    opt.shardc_params = params


def _cast_grads(params, engine) -> None:
    """Low-precision grad shards: give the optimizer fp32 copies of its OS slices."""
    it = iter(params)
    for u in engine.units:
        g = u.trainable
        if g is None:
            continue
        os32 = g.os_grad.float()
        for _ in _pieces(u.index, g):
            next(it).grad = os32[_[1]:_[2]]
