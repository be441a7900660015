"""The module's parameters as torch sees them — stage: runtime (state).

Input: the engine's units (their flat groups' stored tensors), the step boundary, the
unit collectives and the DTensor (TP) parameters. Output: `ParamSet`, one `ShardParam`
per original parameter (what `sm.parameters()` / `sm.named_parameters()` yield, from
construction on), each with its `ShardGrad` after a backward; what torch's own
optimizers, `clip_grad_norm_` and parameter counting read from them.

[Note: a parameter is this rank's piece, with the whole tensor's metadata]
FSDP2's parameters are DTensors: their `shape` and `numel()` are the whole tensor's, their
data the rank's shard. shardc's shard of a parameter is an element range of a unit's flat
buffer (runtime/state/pieces.py), which no DTensor placement describes, so a `ShardParam`
is an `nn.Parameter` holding this rank's piece (a view of the fp32 master over the optim
levels; a frozen parameter's, of the params shard over the params levels) whose
`shape`, `size()`, `dim()` and `numel()` are the whole parameter's, as a DTensor's are:
counting parameters, and `p.dim() >= 2` weight-decay splits (nanoGPT), give the unsharded
model's answers. `to_local()` is the piece, `full_tensor()` the whole tensor (a collective).
Element-wise arithmetic, which is what torch's optimizers do, runs on the piece. What
would silently act on the piece as if it were the whole tensor is refused in one sentence
naming the call: views and reshapes (`parameters_to_vector`), indexing, concatenation,
and reductions other than norms. Norms (`torch._foreach_norm`, `vector_norm`, `norm`) are
the whole tensor's: each rank's partial sums are all-reduced over the piece's levels
(and over tp for a tp-sharded DTensor parameter), recorded in the ledger.

[Note: gradients]
At the end of every backward each trainable parameter gets its `ShardGrad`: a view of the
grad shard's optim slice with the same metadata rules, so `clip_grad_norm_(sm.parameters())`
takes the whole model's norm and scales the slices in place. Any torch call on a
`ShardGrad` first completes the step's gradient sync (`StepBoundary.wait_sync`), so no
caller reads a gradient before it is reduced and averaged. A grad shard kept in bf16 is
read through an fp32 copy of the slice, refreshed when the sync completes; `zero_grad()`
frees those copies (storage resized to 0) until the next read refills them, and the grad
shards themselves (runtime/groups/storage.py [Note: grad shard lifetime]): between zero_grad()
and the next step's sync neither holds bytes. Zeroing a gradient in place writes nothing. Zeroing is
torch's: `p.grad = None` (`zero_grad()`, set_to_none) or zeroing the gradient in place
(`zero_grad(set_to_none=False)`) resets the step (`StepBoundary.zero_grad`); the next
backward attaches the gradients again. A parameter frozen after sharding
(`requires_grad_(False)`) gets no gradient, so no optimizer updates it (as with FSDP2).
"""
from __future__ import annotations

from collections.abc import Mapping

import types
from math import prod

import torch
from torch import nn

from shardc.lowering import RELEASE_GRADS, Over

from ..step.boundary import StepPhase
from ..errors import RuntimeUsageError
from . import norms
from .norms import flat_args, unwrapped
from .pieces import PieceSpec, gather

_T = torch.Tensor
RESHAPES = {_T.view, _T.view_as, _T.reshape, _T.reshape_as, _T.flatten, _T.unflatten, torch.flatten,
            torch.reshape, _T.__getitem__, _T.__setitem__, _T.narrow, _T.select, _T.split, _T.chunk,
            _T.unbind, torch.split, torch.chunk, torch.unbind, _T.t, _T.transpose, _T.permute, _T.movedim,
            _T.squeeze, _T.unsqueeze, _T.expand, _T.expand_as, _T.repeat, _T.unfold, torch.cat,
            torch.stack, torch.hstack, torch.vstack, torch.concat, torch.concatenate, torch.t,
            torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze, torch.narrow, torch.select}
REDUCTIONS = {_T.sum, torch.sum, _T.mean, torch.mean, _T.max, torch.max, _T.min, torch.min, _T.amax,
              torch.amax, _T.amin, torch.amin, _T.prod, torch.prod, _T.std, torch.std, _T.var, torch.var,
              torch.std_mean, torch.var_mean, _T.median, torch.median, _T.argmax, torch.argmax,
              _T.argmin, torch.argmin, _T.all, torch.all, _T.any, torch.any, _T.count_nonzero,
              torch.count_nonzero, _T.nansum, torch.nansum, _T.nanmean, torch.nanmean, _T.logsumexp,
              torch.logsumexp, torch.aminmax, _T.aminmax, _T.topk, torch.topk, _T.sort, torch.sort,
              _T.kthvalue, torch.kthvalue, _T.cumsum, torch.cumsum, torch.dot, _T.dot, torch.dist,
              _T.dist, torch.linalg.matrix_norm, torch.linalg.vector_norm, torch.norm, _T.norm,
              torch.linalg.norm, torch._foreach_norm, torch.unique, _T.unique, torch.equal, _T.equal,
              torch.allclose, _T.allclose}
NORMS = {torch.linalg.vector_norm, torch.norm, _T.norm, torch.linalg.norm, torch._foreach_norm}
ZEROING = {_T.zero_, torch._foreach_zero_}
_GRAD_SET = _T.grad.__set__            # a method-wrapper: compared with ==


class _Whole:
    """The whole parameter's metadata on a piece (see [Note: a parameter is this rank's piece])."""
    _shardc_spec: PieceSpec

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shardc_spec.global_shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    ndimension = dim

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return prod(self.shape)

    nelement = numel

    def __len__(self) -> int:
        return self.shape[0]

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor (global shape), gathered from every rank's piece. Collective."""
        return self._shardc_set.whole(self._shardc_spec, self.to_local())

    def to_local(self) -> torch.Tensor:
        """This rank's piece (a plain tensor sharing its storage; without the padding a last
        piece carries)."""
        spec = self._shardc_spec
        with torch._C.DisableTorchFunctionSubclass():
            return self.detach()[:spec.hi - spec.lo]

    def __repr__(self) -> str:
        spec = self._shardc_spec
        return (f"{type(self).__name__}({spec.name!r}, shape={tuple(self.shape)}, "
                f"this rank's piece: elements [{spec.lo}, {spec.hi}) of {self.numel()})")

    def __deepcopy__(self, memo):
        raise RuntimeUsageError(f"{self._shardc_spec.name!r} is a shardc parameter (this rank's piece of it), "
                                f"which cannot be deep-copied; copy values through sm.full_state_dict() or "
                                f"sm.state_dict(), and shard a copy of the model with shardc.compile")

    @property
    def _is_whole(self) -> bool:
        """Every rank's piece is the whole parameter (its levels' factor is 1): so on every
        rank alike, which decides whether a call is local or a collective."""
        spec = self._shardc_spec
        return spec.tp is None and spec.ranks == 1

    @classmethod
    def _refuse(cls, func, args, kwargs) -> None:
        if func in NORMS:
            return
        what = getattr(func, "__name__", str(func))
        mine = next(a for a in flat_args(args, kwargs) if isinstance(a, _Whole))
        spec = mine._shardc_spec
        kind = "reduces" if func in REDUCTIONS else "reshapes or indexes"
        raise RuntimeUsageError(
            f"{what}() {kind} {spec.name!r}{' (its gradient)' if isinstance(mine, ShardGrad) else ''}, but on a "
            f"shardc model that tensor is this rank's piece ({spec.hi - spec.lo} of "
            f"{prod(spec.global_shape)} elements): use its full_tensor() (every rank calls it), "
            f"sm.full_state_dict(), or sm.clip_grad_norm_() for clipping")


class ShardParam(_Whole, nn.Parameter):
    """One parameter of a sharded model: this rank's piece with the whole tensor's metadata."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "__set__" and func == _GRAD_SET and args[1] is None:
            args[0]._shardc_set.grad_cleared(args[0])
        return _dispatch(cls, func, args, kwargs)


class ShardGrad(_Whole, torch.Tensor):
    """A trainable parameter's gradient: a view of the synced grad shard (see [Note: gradients])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != "__get__":
            owner = _set_of(args, kwargs)
            if func in ZEROING:
                owner.grads_zeroed()
                return _zeroed(func, args)
            owner.settle("reading a gradient")
        return _dispatch(cls, func, args, kwargs)

    def full_tensor(self) -> torch.Tensor:
        self._shardc_set.settle("reading a gradient")
        return self._shardc_set.whole(self._shardc_spec, self.to_local())


class ShardTensor(_Whole, torch.Tensor):
    """`p.detach()`, `p.data` or `p.clone()` of a parameter or gradient: the same piece (a copy,
    for clone) with the same whole-tensor metadata and rules (see [Note: a parameter is this
    rank's piece])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(cls, func, args, kwargs)


def _zeroed(func, args):
    """Zeroing shardc gradients in place: the step is reset (`grads_zeroed`), which leaves
    the grad shards logically zero and their storage freed (runtime/groups/storage.py [Note: grad
    shard lifetime]), so nothing is written to them; other tensors in the list are zeroed."""
    if func is torch._foreach_zero_:
        rest = [t for t in args[0] if not isinstance(t, _Whole)]
        if rest:
            torch._foreach_zero_(rest)
        return None
    return args[0]


KEEPS = {_T.detach, _T.clone, torch.clone, torch.detach}
_DATA_GET = _T.data.__get__                        # a method-wrapper: compared with ==


def _dispatch(cls, func, args, kwargs):
    """The rules every shardc tensor follows (see [Note: a parameter is this rank's piece])."""
    if func in NORMS and not _has_dim(func, args, kwargs):
        return _set_of(args, kwargs).norms(func, args, kwargs)      # even on whole pieces: one clip
    if func in RESHAPES or func in REDUCTIONS:
        if _all_whole(args, kwargs):
            return _on_whole(func, args, kwargs)
        cls._refuse(func, args, kwargs)
        return _set_of(args, kwargs).norms(func, args, kwargs)
    out = _plain(func, args, kwargs)
    keep = func in KEEPS or (getattr(func, "__name__", "") == "__get__" and func == _DATA_GET)
    return _kept(out, args[0]) if keep and isinstance(args[0], _Whole) else out


def _has_dim(func, args, kwargs) -> bool:
    """A norm along dims (local on whole pieces, refused on others: runtime/state/norms.py)."""
    return func is not torch._foreach_norm and (len(args) > 2 or (kwargs or {}).get("dim") is not None)


def _kept(out, of: "_Whole"):
    """A detached or cloned piece keeps its whole-tensor metadata (a ShardTensor)."""
    if not isinstance(out, torch.Tensor) or isinstance(out, _Whole):
        return out
    kept = out.as_subclass(ShardTensor)
    kept._shardc_spec, kept._shardc_set = of._shardc_spec, of._shardc_set
    return kept


def _plain(func, args, kwargs):
    """`func` on the pieces as they are. On meta tensors (a simulated rank:
    runtime/simulation.py) torch's meta kernels are Python and read `.shape`, which is the
    whole parameter's here, so torch's operators (not attributes, not Python-level methods
    such as hook registration) get the pieces as plain tensors (aliases of the same storage)."""
    with torch._C.DisableTorchFunctionSubclass():
        if not isinstance(func, types.FunctionType) and getattr(func, "__name__", "") not in ("__get__", "__set__") \
                and any(isinstance(a, _Whole) and a.is_meta for a in flat_args(args, kwargs)):
            args, kwargs = unwrapped(tuple(args), _Whole), {k: unwrapped(v, _Whole) for k, v in (kwargs or {}).items()}
        return func(*args, **(kwargs or {}))


def _all_whole(args, kwargs) -> bool:
    return all(a._is_whole for a in flat_args(args, kwargs) if isinstance(a, _Whole))


def _on_whole(func, args, kwargs):
    """A call on pieces that are each the whole parameter (replicated optimizer states):
    run on the values in their true shape."""
    def whole(a):
        if isinstance(a, _Whole):
            return a.to_local().view(a._shardc_spec.shape)
        if isinstance(a, (list, tuple)):
            return type(a)(whole(x) for x in a)
        return a
    with torch._C.DisableTorchFunctionSubclass():
        return func(*whole(tuple(args)), **{k: whole(v) for k, v in (kwargs or {}).items()})


def _set_of(args, kwargs) -> "ParamSet":
    return next(a._shardc_set for a in flat_args(args, kwargs) if isinstance(a, _Whole))


class ParamSet:
    """Every parameter of one ShardedModule as a `ShardParam` (see the module notes)."""

    def __init__(self, units, order: list[str], tp: dict, comm, ledger, boundary, comms: dict | None = None,
                 owned_plan=None, clip_rows=(), clip_tp: dict | None = None):
        self.comm, self.ledger, self.boundary, self.tp = comm, ledger, boundary, tp
        # what a clip's total reads, as sm.clip_grad_norm_ does (runtime/step/clip.py [Note: one
        # clip]): the plan's clip rows and the tensor-parallel parameters (not the experts' DTensors)
        self.clip_rows, self.clip_tp = clip_rows, tp if clip_tp is None else clip_tp
        self.owned_plan = owned_plan                # the plan's owners (Lowering.owned; runtime/step/owned.py)
        self._comms = comms or {Over.DENSE: comm}   # the Comm of each placement's mesh (`Over`)
        self.params: dict[str, ShardParam] = {}
        self.grads = _LazyGrads(self._grad_views)  # name -> (ShardGrad, plain view, storage), made at first use
        found = {}
        self._clip: dict[str, tuple] = {}            # name -> its placement's (clip_levels, clip_weight)
        for u in units:
            for g in u.groups:
                pl = g.gplan.placement
                for spec, local in self.pieces(g.storage):
                    found[spec.name] = (spec, local, g.storage)
                    self._clip.setdefault(spec.name, (pl.clip_levels, pl.clip_weight))
        for name in order:
            if name in found and name not in self.params:
                spec, local, st = found[name]
                p = ShardParam(local, requires_grad=st.trainable)
                p._shardc_spec, p._shardc_set = spec, self
                self.params[name] = p
                if st.trainable:
                    self.grads.plan(name, spec, st)
        self.optimizers: list = []                   # weakrefs to adopted optimizers (runtime/step/optimizer.py)
        self.owned: list = []                        # those sm.optimizer() built: kept alive, as before
        self._settled = None                         # the boundary generation the grads were read at
        self.unset: set[str] = set()                 # parameters without values yet (runtime/build.py)
        self.unset_buffers: dict = {}                # buffers materialized as NaN, never given a value

    def pieces(self, st, shard: bool = False):
        """(PieceSpec, local tensor) per parameter of storage `st`: its OS chunk of the
        master when trainable, its params chunk of the shard when frozen (or `shard`: a load
        filling a trainable group's params shard, whose master is a view of it); the chunk's
        padding rides on the last parameter ([Note: the padding rides on the last piece]
        in runtime/state/pieces.py)."""
        plan, over = st.plan, st.over
        if st.trainable and not shard:
            levels, state, start, length, src = plan.os, "optim", st.os_start, st.os_len, st.master
        else:
            levels, state, start, length, src = plan.p, "params", st.p_start, st.p_len, st.shard
        ranks = plan.s(levels)
        ranges = st.layout.ranges(start, length)
        for k, (slot, lo, hi) in enumerate(ranges):
            a, b = lo, hi
            if k == len(ranges) - 1:                   # the padding in this chunk, if any
                a = lo if hi > lo else max(0, min(length, st.layout.phi - start))
                b = length
            spec = PieceSpec(slot.fqn, slot.shape, slot.offset, length, levels, plan.order(state),
                             ranks, start // length if length else 0, self.tp.get(slot.fqn),
                             pad=(b - a) - (hi - lo), over=over,
                             comm=self._comms[over] if over != Over.DENSE else None)
            yield spec, src[a:b]

    def _grad_views(self, spec: PieceSpec, st):
        real = spec.hi - spec.lo
        lo = spec.offset + spec.lo - st.os_start if real else st.os_len - spec.pad
        hi = lo + real + spec.pad
        if st.gdtype == torch.float32:
            plain = st.grad_shard[st.os_in_g + lo:st.os_in_g + hi]
        else:                                        # refreshed from the bf16 slice by settle()
            plain = torch.zeros(hi - lo, dtype=torch.float32, device=st.grad_shard.device)
        sg = plain.as_subclass(ShardGrad)
        sg._shardc_spec, sg._shardc_set = spec, self
        return sg, plain, st, lo, hi

    # -- values ------------------------------------------------------------------------------
    def require(self, what: str, names=None) -> None:
        """`what` needs every parameter's (and buffer's) value, or those of `names` only (no
        buffer): one sentence naming those without one."""
        unset = self.unset if names is None else self.unset & set(names)
        if unset:
            names = sorted(unset)
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise RuntimeUsageError(
                f"{what} needs the parameters' values, but {names[0]!r}{more} never got one (the model was "
                f"built on the meta device and neither init nor a load gave it values): pass shardc.compile "
                f"init=fn, or load a checkpoint (DCP, sm.load_state_dict, shardc.load_safetensors) first")
        if self.unset_buffers and names is None:
            self.unset_buffers = {n: b for n, b in self.unset_buffers.items() if bool(torch.isnan(b).all())}
            if self.unset_buffers:
                name = next(iter(self.unset_buffers))
                raise RuntimeUsageError(
                    f"{what} needs the buffers' values, but buffer {name!r} never got one (the model was built "
                    f"on the meta device, a load does not cover a non-persistent buffer, and no init set it): "
                    f"pass shardc.compile init=fn, or init=shardc.buffers_only(fn) to set buffers only "
                    f"(Hugging Face: model._init_weights)")

    def expect_values(self, names, buffers: dict | None = None) -> None:
        """These parameters (and NaN buffers) have no values until a load or init gives them
        (build: a meta-device model; a load that failed part-way: all of them)."""
        self.unset |= set(names)
        if buffers is not None:
            self.unset_buffers = dict(buffers)

    def loaded(self, names) -> None:
        self.unset -= set(names)

    # -- gradients ---------------------------------------------------------------------------
    def attach_grads(self) -> None:
        """End of a backward: every trainable parameter that has none gets its ShardGrad."""
        for name, p in self.params.items():
            if name in self.grads and p.requires_grad and _grad(p) is None:
                _set_grad(p, self.grads[name][0])

    def settle(self, what: str) -> None:
        """Before a gradient is read: the step's sync completes (waited, averaged); a bf16
        grad shard's slices are copied into the fp32 gradients."""
        self.boundary.wait_sync(what)
        if self._settled == self.boundary.generation:
            return
        self._settled = self.boundary.generation
        for st in {id(st): st for _, _, st, _, _ in self.grads.values()}.values():
            st.materialize()
        for _, plain, st, lo, hi in self.grads.values():
            if st.gdtype != torch.float32 and hi > lo:
                _storage_back(plain).copy_(st.os_grad[lo:hi])

    def release_fp32_grads(self) -> None:
        """zero_grad(): the fp32 copies a bf16 grad shard is read through are freed (resized
        to 0) until the next settle() refills them ([Note: gradients]; shardc.lowering
        [Note: gradient lifetimes])."""
        if not RELEASE_GRADS:
            return
        for _, plain, st, _, _ in self.grads.made():
            if st.gdtype != torch.float32:
                plain.untyped_storage().resize_(0)

    def drop_frozen_grads(self) -> None:
        """Parameters frozen after sharding (`requires_grad_(False)`) get no gradient: their
        slices of the synced grad shard are zeroed before sm.clip_grad_norm_ reads them."""
        for name, (_, _, st, lo, hi) in self.grads.items():
            if not self.params[name].requires_grad and hi > lo:
                st.os_grad[lo:hi].zero_()

    def grads_changed(self) -> None:
        """The grad shards were written outside a sync (sm.clip_grad_norm_): re-read them."""
        self._settled = None

    def live_optimizers(self) -> list:
        return [o for o in (r() for r in self.optimizers) if o is not None]

    def ours(self, p) -> bool:
        """Does parameter p hold the gradient shardc gave it (ShardGrad or its plain view)?"""
        g = _grad(p)
        entry = self.grads.get(p._shardc_spec.name)
        return g is not None and entry is not None and (g is entry[0] or g is entry[1])

    def plain_grads(self, params) -> None:
        """For an optimizer's step: plain views instead of ShardGrads (no per-op dispatch)."""
        self._swap(params, 0, 1)

    def shard_grads(self, params) -> None:
        """After the step: the ShardGrads again."""
        self._swap(params, 1, 0)

    def _swap(self, params, have: int, want: int) -> None:
        for p in params:
            entry = self.grads.get(p._shardc_spec.name)
            if entry is not None and _grad(p) is entry[have]:
                _set_grad(p, entry[want])

    def grad_cleared(self, p) -> None:
        """`p.grad = None` (zero_grad): the step is over; the shards are zeroed lazily."""
        if p._shardc_spec.name in self.grads:
            self.grads_zeroed()

    def grads_zeroed(self) -> None:
        if self.boundary.phase is not StepPhase.FRESH:
            self.boundary.zero_grad()

    def clear_grads(self) -> None:
        for p in self.params.values():
            _set_grad(p, None)

    # -- whole tensors -------------------------------------------------------------------------
    def whole(self, spec: PieceSpec, local: torch.Tensor) -> torch.Tensor:
        return gather(self.comm, spec, local)

    def norms(self, func, args, kwargs):
        """A whole-tensor norm of each shardc tensor, partial until read (runtime/state/norms.py
        [Note: lazy norms])."""
        return norms.norms(self, func, args, kwargs, lambda t: isinstance(t, _Whole))

    def comm_of(self, over: Over):
        """The Comm of placement kind `over`'s mesh."""
        return self._comms[over]

    def clip_of(self, spec: PieceSpec) -> tuple[tuple[str, ...], int]:
        """The clip levels and weight of the group holding `spec`'s piece (its placement's)."""
        return self._clip[spec.name]


class _LazyGrads(Mapping):
    """name -> a parameter's gradient views, each made at its first read, so building the
    ParamSet does not allocate the grad shards (runtime/groups/storage.py [Note: grad shard lifetime])."""

    def __init__(self, make):
        self._make, self._planned, self._made = make, {}, {}

    def plan(self, name: str, spec, st) -> None:
        self._planned[name] = (spec, st)

    def __getitem__(self, name):
        if name not in self._made:
            spec, st = self._planned[name]
            self._made[name] = self._make(spec, st)
        return self._made[name]

    def __iter__(self):
        return iter(self._planned)

    def __len__(self) -> int:
        return len(self._planned)

    def __contains__(self, name) -> bool:
        return name in self._planned

    def made(self):
        """The views made so far (allocating nothing)."""
        return list(self._made.values())


def _storage_back(t: torch.Tensor) -> torch.Tensor:
    """`t` (a whole fp32 copy: its own storage) with its storage given back if released."""
    need = t.numel() * t.element_size()
    if t.untyped_storage().size() != need:
        t.untyped_storage().resize_(need)
    return t


def _grad(p):
    with torch._C.DisableTorchFunctionSubclass():
        return p.grad


def _set_grad(p, g) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        p.grad = g
