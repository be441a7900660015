"""Sharded optimizer — stage: runtime.

Input: the engine's trainable flat groups, a torch.optim class, per-name param groups.
Output: a plain `torch.optim.Optimizer` instance over this rank's optimizer shard:
one parameter per (original trainable parameter ∩ this rank's OS chunk), empty where
they do not meet, plus one padding piece, each an `nn.Parameter` view of the fp32 master
whose `.grad` is a view of the grad shard. Step hooks wait for the gradient sync before
the update and run the update re-gather after it; `zero_grad` zeroes the grad shards in
place and (set_to_none, the default) detaches the grad views, which the next step
re-attaches only if a backward ran since (so a step without one moves nothing, as in
PyTorch). The ShardedModule then attaches the checkpoint hooks (runtime/checkpoint.py)
that turn `state_dict()` into per-parameter, padding-free entries.

[Note: one piece per parameter on every rank]
Every rank's optimizer has a piece for every trainable parameter (zero elements where
its OS chunk misses the parameter), in the same order, so `param_groups[i]["params"]`
names the same parameters on every rank and in every strategy — what torch's
`get_state_dict`/`set_state_dict` need when rank 0 writes the param groups once.
Padding pieces have `requires_grad=False`: torch's state-dict helpers skip their state,
and they never reach a checkpoint.

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

from shardc.lowering.optimizers import OPTIMIZER_KINDS

from .boundary import StepPhase
from .errors import RuntimeUsageError

ELEMENTWISE = tuple(getattr(torch.optim, n) for n, k in OPTIMIZER_KINDS.items() if k.elementwise)


@dataclass(frozen=True, slots=True)
class Piece:
    name: str          # original parameter FQN, or "<padding>:<unit>"
    unit: int
    start: int         # element range in the unit's full flat buffer
    stop: int


def _pieces(unit: int, st) -> list[tuple[Piece, int, int]]:
    """(piece, lo, hi) with lo/hi relative to the OS chunk of storage `st`; every slot, then
    the padding."""
    a, b = st.os_start, st.os_start + st.os_len
    out = [(Piece(s.fqn, unit, a + lo, a + hi), lo, hi) for s, lo, hi in st.layout.ranges(a, st.os_len)]
    lo, hi = max(a, st.layout.phi), b
    if lo < hi:
        out.append((Piece(f"<padding>:{unit}", unit, lo, hi), lo - a, hi - a))
    return out


def _check_cls(cls, boundary) -> None:
    if cls in ELEMENTWISE:
        return
    sharded = any(g.storage.s_os > 1 for g in boundary.trainable_groups())
    if sharded:
        raise RuntimeUsageError(
            f"{getattr(cls, '__name__', cls)} is not an element-wise optimizer, so it cannot "
            f"run on sharded optimizer states; use one of "
            f"{', '.join(c.__name__ for c in ELEMENTWISE)} or 'optim replicate'")


def build_optimizer(boundary, aliases: dict[str, str], frozen: set[str], cls,
                    param_groups=None, **kw) -> torch.optim.Optimizer:
    """The optimizer over this rank's pieces; `boundary` is the engine's StepBoundary."""
    _check_cls(cls, boundary)
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
    views: list[tuple] = []             # (storage, lo, hi) per piece: where its grad lives
    for ui, g in [(u.index, u.trainable.storage) for u in boundary.units if u.trainable is not None]:
        for piece, lo, hi in _pieces(ui, g):
            padding = piece.name.startswith("<padding>")
            p = nn.Parameter(g.master[lo:hi], requires_grad=not padding)
            target = groups[wanted[piece.name]] if piece.name in wanted else default
            target["params"].append(p)
            pieces.append(piece)
            ordered.append(p)
            views.append((g, lo, hi))
    opt = cls(groups + [default], **kw)
    _attach(opt, boundary, pieces, ordered, views)
    return opt


def _attach(opt, boundary, pieces, params, views) -> None:
    # fp32 grad shards: the pieces' grads are views of them, made once
    fixed = [g.os_grad[lo:hi] if g.gdtype == torch.float32 else None for g, lo, hi in views]

    def attach_grads() -> None:
        for g in {id(g): g for g, _, _ in views}.values():
            g.materialize()                    # a zero_grad() not followed by a backward
        cast = {}
        for p, grad, (g, lo, hi) in zip(params, fixed, views):
            if grad is not None:
                p.grad = grad
            else:                      # low-precision grad shard: an fp32 copy of the slice
                if id(g) not in cast:
                    cast[id(g)] = g.os_grad.float()
                p.grad = cast[id(g)][lo:hi]

    fresh = [False]

    def pre(optimizer, args, kwargs):
        boundary.wait_sync("opt.step()")
        fresh[0] = boundary.phase is StepPhase.FRESH
        if not fresh[0]:                         # a backward ran since zero_grad()
            attach_grads()

    def post(optimizer, args, kwargs):
        if any(p.grad is not None for p in params):
            boundary.after_step()
        if fresh[0]:                             # no gradients were consumed: still fresh
            boundary.phase = StepPhase.FRESH

    def zero_grad(self, set_to_none: bool = True):
        boundary.zero_grad()
        for p in params:
            p.grad = None
        if not set_to_none:
            attach_grads()

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    opt.zero_grad = types.MethodType(zero_grad, opt)
    opt.shardc_pieces = pieces
    opt.shardc_params = params
