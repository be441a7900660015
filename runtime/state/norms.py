"""Whole-tensor norms of shardc parameters and gradients — stage: runtime (state).

Input: a norm call torch makes on `ShardParam`/`ShardGrad` pieces (runtime/state/params.py
routes `torch._foreach_norm`, `vector_norm`, `norm` here), the pieces' `PieceSpec`s, the
placement (clip levels and weight) of each piece's group. Output: each tensor's whole
norm, as a `PartialNorm` until something reads it.

[Note: lazy norms]
torch's `clip_grad_norm_(sm.parameters())` takes each gradient's norm, stacks them and
takes the norm of that (`torch.nn.utils.get_total_norm`), then divides `max_norm` by it.
Reducing each tensor's norm as it is taken costs one all-reduce per call and is not what
explain predicts. As a DTensor's norm is a `Partial` placement reduced when read, a norm
of a finite p > 0 here is a `PartialNorm`: this rank's partial sum of |x|^p, not yet
reduced. `torch.stack` of them and `.to()` onto their own device stay partial, and
`vector_norm` of such a stack with the same p is the total, still partial. The first
other call on one reduces it: a total through `runtime/step/clip.py` `total_norm`, the
implementation `sm.clip_grad_norm_` runs (so both record the plan's clip rows, [Note:
one clip] there); a tensor's own norm (or a stack of them) through an all-reduce of the
partials over each piece's levels, recorded as a `norm_row`. After that it is a plain
value. p = inf and p = 0 are reduced at once (max and count do not add across a stack).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardc.lowering.rows import norm_row

from ..errors import RuntimeUsageError
from ..step import clip
from .pieces import PieceSpec

NO_TF = torch._C.DisableTorchFunctionSubclass


def norm_args(func, args, kwargs) -> tuple[list, float, bool]:
    """(tensors, p, single) of a norm call, refusing what is not a whole-tensor vector norm."""
    kw = dict(kwargs or {})
    if func is torch._foreach_norm:
        tensors = list(args[0])
        p = args[1] if len(args) > 1 else kw.get("ord", 2)
        return tensors, float(p), False
    names = {torch.linalg.vector_norm: "ord", torch.linalg.norm: "ord"}.get(func, "p")
    p = args[1] if len(args) > 1 else kw.get(names, None)
    dim = args[2] if len(args) > 2 else kw.get("dim", None)
    if dim is not None:
        raise RuntimeUsageError(f"{func.__name__}(dim=...) on a shardc parameter or gradient reduces rows of "
                                f"the whole tensor, which this rank does not hold; take the norm of the whole "
                                f"tensor (no dim), or use full_tensor()")
    if p is None or p == "fro":
        p = 2
    if isinstance(p, str):
        raise RuntimeUsageError(f"{func.__name__}(p={p!r}) is a matrix norm; on a shardc parameter or "
                                f"gradient only vector norms of the whole tensor are computed")
    return [args[0]], float(p), True


def partial(t: torch.Tensor, p: float) -> torch.Tensor:
    """This rank's share of a p-norm: sum |x|^p (max |x| for p = inf, count for p = 0)."""
    x = t.detach().float()
    if math.isinf(p):
        return x.abs().amax() if x.numel() else torch.zeros((), device=x.device)
    if p == 0:
        return (x != 0).sum().float()
    return x.abs().pow(p).sum()


def finish(total: torch.Tensor, p: float) -> torch.Tensor:
    if math.isinf(p) or p == 0:
        return total
    return total.pow(1.0 / p)


def norms(pset, func, args, kwargs, is_ours):
    """A whole-tensor vector norm of each shardc tensor (see [Note: lazy norms]); plain
    tensors mixed in keep their own."""
    tensors, p, single = norm_args(func, args, kwargs)
    lazy = not math.isinf(p) and p > 0
    out = []
    for t in tensors:
        with NO_TF():
            if not is_ours(t):
                out.append(torch.linalg.vector_norm(t, p))
                continue
            part, like = partial(t, p), torch.empty((), device=t.device)
        out.append(PartialNorm.of(pset, [(t._shardc_spec, part)], p, t.dtype, like))
        if not lazy:
            out[-1].settle()
    return out[0] if single else out


def reduce_each(pset, partials: torch.Tensor, specs: list[PieceSpec], p: float) -> None:
    """Sum (max for p = inf) each entry over its piece's levels, then over tp where the
    parameter is tp-sharded; recorded as `norm_row`s."""
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    by_levels: dict[tuple, list[int]] = {}
    for k, s in enumerate(specs):
        by_levels.setdefault((s.levels, s.over), []).append(k)
    for (levels, over), ks in by_levels.items():
        group = pset.comm_of(over).smesh.group(levels)
        if group is None:
            continue
        idx = torch.tensor(ks, device=partials.device)
        part = partials.index_select(0, idx)
        dist.all_reduce(part, op=op, group=group)
        partials.index_copy_(0, idx, part)
        pset.ledger.record_row(norm_row(levels, part.numel() * part.element_size(), over=over))
    sharded = [k for k, s in enumerate(specs) if s.tp is not None and s.tp.sharded]
    if sharded:
        idx = torch.tensor(sharded, device=partials.device)
        part = partials.index_select(0, idx)
        dist.all_reduce(part, op=op, group=specs[sharded[0]].tp.mesh.get_group())
        partials.index_copy_(0, idx, part)


class PartialNorm(torch.Tensor):
    """A norm of shardc pieces not yet reduced over the ranks ([Note: lazy norms]): a 0-dim
    norm, a stack of them (1-dim), or their total (`total`)."""
    _pset: object
    _entries: list                      # (PieceSpec, this rank's partial) per element
    _p: float
    _total: bool
    _pending: bool

    @staticmethod
    def of(pset, entries, p: float, dtype, like: torch.Tensor, total: bool = False) -> "PartialNorm":
        with NO_TF():
            t = torch.empty_like(like, dtype=dtype).as_subclass(PartialNorm)
        t._pset, t._entries, t._p, t._total, t._pending = pset, entries, p, total, True
        return t

    def settle(self) -> "PartialNorm":
        """Reduce over the ranks (once); afterwards this is a plain value."""
        if not self._pending:
            return self
        self._pending = False
        pset, p = self._pset, self._p
        with NO_TF():
            if self._total:
                parts = [(*pset.clip_of(spec), part * clip.tp_weight(pset.clip_tp, spec.name))
                         for spec, part in self._entries]
                value = clip.total_norm(parts, pset.clip_rows, pset.comm, pset.clip_tp, p, self.device)
            else:
                partials = torch.stack([part.float() for _, part in self._entries])
                reduce_each(pset, partials, [spec for spec, _ in self._entries], p)
                value = finish(partials, p)
            self.copy_(value.reshape(self.shape))
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__":          # .device, .dtype, .shape: no reduction
            with NO_TF():
                return func(*args, **kwargs)
        kept = _stays_partial(func, args, kwargs)
        if kept is not None:
            return kept
        for a in flat_args(args, kwargs):
            if isinstance(a, PartialNorm):
                a.settle()
        with NO_TF():
            return func(*unwrapped(args), **{k: unwrapped(v) for k, v in kwargs.items()})


def _pending(t) -> bool:
    return isinstance(t, PartialNorm) and t._pending


def _stays_partial(func, args, kwargs):
    """What keeps a pending norm partial ([Note: lazy norms]); None for everything else."""
    if func is torch.Tensor.to and _pending(args[0]) and not kwargs \
            and all(isinstance(a, (torch.device, str)) and torch.device(a) == args[0].device for a in args[1:]):
        return args[0]
    if func is torch.stack and args and isinstance(args[0], (list, tuple)) and args[0] \
            and (args[1] if len(args) > 1 else kwargs.get("dim", 0)) == 0 and set(kwargs) <= {"dim"}:
        ts = args[0]
        first = ts[0]
        if all(_pending(t) and not t._total and t.ndim == 0 and t._pset is first._pset and t._p == first._p
               and t.dtype == first.dtype for t in ts):
            with NO_TF():
                like = torch.empty(len(ts), dtype=first.dtype, device=first.device)
            return PartialNorm.of(first._pset, [e for t in ts for e in t._entries], first._p, first.dtype, like)
    if func is torch.linalg.vector_norm and _pending(args[0]) and not args[0]._total and args[0].ndim == 1:
        p = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        rest = {k: v for k, v in kwargs.items() if k != "ord"}
        if len(args) <= 2 and not rest and float(p) == args[0]._p:
            v = args[0]
            with NO_TF():
                like = torch.empty((), dtype=v.dtype, device=v.device)
            return PartialNorm.of(v._pset, v._entries, v._p, v.dtype, like, total=True)
    return None


def flat_args(args, kwargs):
    """A call's arguments, lists and tuples opened one level (shardc tensors come in lists)."""
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def unwrapped(a, cls=None):
    """`a` with each `cls` tensor in it (default: PartialNorm) a plain tensor of the same storage."""
    if isinstance(a, cls or PartialNorm):
        return a.as_subclass(torch.Tensor)
    if isinstance(a, (list, tuple)):
        return type(a)(unwrapped(x, cls) for x in a)
    return a
