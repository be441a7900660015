"""Parameters no op has touched yet — stage: runtime (state). The first rank's init
(init_first.py) lays each parameter out as a view of its group's buffer; this tells which of
those views an init function wrote whole before anything read them, so they need no NaN.

Input: the views (`add`: a buffer's storage, the slot's offset and size, the view) and the
aten ops the init function runs while `watch()` is active. Output: each view either marked
touched (its values are the op's) or filled with NaN right before the first op that could
read it (`settle`: a view no op touched, filled when its parameter is final).

[Note: NaN only where it can be seen]
init.py marks a parameter without a value by materializing it as NaN: whatever is still all
NaN after every call got no value (`unset`). Filling each parameter first costs a write of
every byte before the init writes it again: on the first rank, which draws the whole model
alone, 0.41 of its 1.2 CPU s of values (1-layer 175M Llama, 4 gloo ranks, cProfile). The
NaN matters only to an op that reads the old contents, and to the final check. So the fill
is deferred: an op that overwrites a whole view without reading it (`OVERWRITES`: the
random fills, `fill_`, `zero_`, `copy_` into it) with the view exactly as its first
argument marks it touched and runs; any other op whose tensor arguments overlap a view not
yet touched (a read, a partial write: `weight[pad].zero_()` before a draw, an in-place
`mul_`) first fills that whole view with NaN, as init.py would have. A view no op touched
is filled when its last holder ran (`settle`). So every op sees the bytes init.py's path
gives it and every parameter ends as it would there, NaN where unset; the only writes
saved are the NaN fills an overwrite would have replaced. Views are found by storage and
element range, so `.data` aliases (their own version counters) are seen too.

[Note: deferred whole writes]
With a `stream` given (init_first.py), a whole `normal_` or float32 `uniform_` of a view
(draws.py's conditions; the default generator or a CPU one the init passes), a `fill_` of a
number or a `zero_` is not run at all: the op is recorded (a draw is counted on the lagging
generator, draws.py's [Note: a lagging generator]; any other op that draws from a generator
catches that generator up first) and the parameter's buffer is never written, so the first
rank holds no whole parameter (see the next Note). Each rank then runs the recorded op on its own part
(draws.py's instructions, sent instead of values). An op that later reads or partly
writes such a view first replays the recorded op into it (a draw from the state it started
at, the generator put back), so it sees the values one process would have; a later whole
overwrite replaces the record.

[Note: storage at the first real op]
On that path (init_pieces.py) the first rank's parameters are made by `lazy`: a tensor of the
parameter's shape whose storage has no byte (an alias of an empty tensor, so no allocation
is made and torch's MemTracker counts none). A deferred op never reads or writes it; any
other op with such a tensor among its arguments (a view of it too: torch checks a view's
bounds against its storage) first gives the storage its full size (`resize_`, which the
tracker counts), as does `settle` for a view whose values are read next. So a parameter
whose init only draws, fills or zeroes it whole never holds memory on the first rank, as on
the others; one an op reads holds it from that op until it is sent.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .draws import Normal, Uniform, deferrable

aten = torch.ops.aten
OVERWRITES = {aten.normal_, aten.uniform_, aten.fill_, aten.zero_, aten.copy_, aten.random_,
              aten.exponential_, aten.log_normal_, aten.cauchy_, aten.geometric_, aten.bernoulli_}


def storage_key(t: torch.Tensor) -> int:
    """t's storage, the same object whatever its size (a view's and a `.data` alias' too)."""
    return t.untyped_storage()._cdata


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The element range [a, b) of t's storage that t can address."""
    if t.numel() == 0:
        return t.storage_offset(), t.storage_offset()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset(), t.storage_offset() + last + 1


# ops that draw from a generator without a `generator` argument in their schema
_RANDOM = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "native_dropout",
           "dropout", "feature_dropout", "alpha_dropout", "rrelu", "rrelu_with_noise", "multinomial", "poisson",
           "bernoulli", "normal", "uniform", "random", "exponential", "cauchy", "log_normal", "geometric"}


def drawn_from(func, kwargs):
    """The generator `func` may draw from (its `generator=`, else the default one), or None."""
    g = kwargs.get("generator")
    if g is not None:
        return g
    return torch.default_generator if _random(func) else None


@functools.lru_cache(maxsize=None)
def _random(func) -> bool:
    """An op that draws: a random op, or one whose schema takes a generator (per op, once)."""
    name = func.overloadpacket.__name__.rstrip("_")
    return name in _RANDOM or any("Generator" in str(a.type) for a in func._schema.arguments)


class Fill:
    """A deferred whole `fill_(value)` / `zero_()`."""

    def __init__(self, value):
        self.value = value

    def replay(self, view: torch.Tensor) -> None:
        view.fill_(self.value)

    def piece(self, at: int, a: int, b: int) -> tuple:
        return ("fill", at, b - a, self.value)


class Untouched(TorchDispatchMode):
    """The views not yet touched, and those whose only write was deferred, by their buffer's
    storage (its `_cdata`: the same object whatever its size); see the module note and
    [Note: deferred whole writes]."""

    def __init__(self, stream=None):
        super().__init__()
        self.views: dict[int, dict[int, torch.Tensor]] = {}   # storage -> {slot offset: view}
        self.deferred: dict[int, dict[int, tuple]] = {}       # storage -> {slot offset: (view, op)}
        self.stream = stream          # the lagging generator draws are counted on (None: defer nothing)
        self.short: dict[int, torch.Tensor] = {}               # storage -> the `lazy` tensor, not yet given bytes

    def lazy(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous tensor of `shape` whose storage holds no byte until an op other than a
        deferred whole write touches it ([Note: storage at the first real op])."""
        stride = torch.empty(shape, device="meta").stride()
        t = torch.ops.aten._reshape_alias(torch.empty(0, dtype=dtype, device=device), shape, stride)
        self.short[storage_key(t)] = t       # held: its storage's key is not reused while listed
        return t

    def _real(self, t: torch.Tensor) -> None:
        """t's storage its full size, if it was made by `lazy` and has not been given it yet."""
        made = self.short.pop(storage_key(t), None)
        if made is not None:
            t.untyped_storage().resize_(made.numel() * made.element_size())

    def add(self, view: torch.Tensor) -> None:
        self.views.setdefault(storage_key(view), {})[view.storage_offset()] = view

    def settle(self, view: torch.Tensor):
        """View done: its deferred op (Normal, Fill), or None after NaN where no op touched it
        (floating; as init.py materialized it), or None where ops ran on it."""
        op = self.deferred.get(storage_key(view), {}).pop(view.storage_offset(), (None, None))[1]
        if op is not None:
            return op
        self._real(view)              # its values are read next
        if self.forget(view) and view.is_floating_point():
            view.fill_(float("nan"))
        return None

    def pending(self, view: torch.Tensor) -> bool:
        """No op has touched `view` yet."""
        return view.storage_offset() in self.views.get(storage_key(view), {})

    def forget(self, view: torch.Tensor) -> bool:
        """Stop watching `view` (its value comes from elsewhere); True if it was untouched."""
        self.deferred.get(storage_key(view), {}).pop(view.storage_offset(), None)
        mine = self.views.get(storage_key(view), {})
        return mine.pop(view.storage_offset(), None) is not None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.views or self.deferred:
            whole = None
            if func.overloadpacket in OVERWRITES and args and isinstance(args[0], torch.Tensor):
                whole = args[0]
                if self.stream is not None and self._defer(func, args, kwargs):
                    return whole
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    if self.short:
                        self._real(t)      # before any op, a view's too, reads its storage's size
                    self._touch(t, t is whole)
        g = drawn_from(func, kwargs) if self.stream is not None else None
        if g is not None and g.device.type == "cpu":
            self.stream.catch_up(g)            # it draws from the generator: where one process's would be
        return func(*args, **kwargs)

    def _exact(self, t: torch.Tensor):
        """The watched view t covers exactly (untouched or deferred), else None."""
        ptr, off = storage_key(t), t.storage_offset()
        view = self.views.get(ptr, {}).get(off)
        if view is None:
            view = self.deferred.get(ptr, {}).get(off, (None,))[0]
        if view is None or t.numel() != view.numel() or not t.is_contiguous():
            return None
        return view

    def _defer(self, func, args, kwargs) -> bool:
        """A whole `normal_` (draws.py's conditions), `fill_` of a number or `zero_` of a
        watched view: recorded, not run ([Note: deferred whole writes])."""
        t = args[0]
        g = kwargs.get("generator")
        own = g is None or g.device.type == "cpu"          # a CPU generator: one kind, its state ours to count
        if func is aten.normal_.default and own and deferrable(t):
            make = "normal"
        elif func is aten.uniform_.default and own and deferrable(t):
            make = "uniform"
        elif func is aten.fill_.Scalar or func is aten.zero_.default:
            make = "fill"
        else:
            return False
        view = self._exact(t)
        if view is None:
            return False
        if make in ("normal", "uniform"):
            first, second = (("mean", 0.0), ("std", 1.0)) if make == "normal" else (("from", 0.0), ("to", 1.0))
            x = float(args[1]) if len(args) > 1 else float(kwargs.get(first[0], first[1]))
            y = float(args[2]) if len(args) > 2 else float(kwargs.get(second[0], second[1]))
            op = (Normal if make == "normal" else Uniform).drawn(self.stream, view.numel(), x, y, g)
        else:
            op = Fill(args[1] if func is aten.fill_.Scalar else 0)
        ptr, off = storage_key(view), view.storage_offset()
        self.views.get(ptr, {}).pop(off, None)
        self.deferred.setdefault(ptr, {})[off] = (view, op)
        return True

    def _touch(self, t: torch.Tensor, overwrite: bool) -> None:
        ptr = storage_key(t)
        mine, later = self.views.get(ptr), self.deferred.get(ptr)
        if not mine and not later:
            return
        a, b = _extent(t)
        for off in [o for o, v in (mine or {}).items() if o < b and a < o + v.numel()]:
            view = mine.pop(off)
            exact = overwrite and off == a and t.numel() == view.numel() and t.is_contiguous()
            if not exact and view.is_floating_point():
                view.fill_(float("nan"))
        for off in [o for o, (v, _) in (later or {}).items() if o < b and a < o + v.numel()]:
            view, op = later.pop(off)
            if not (overwrite and off == a and t.numel() == view.numel() and t.is_contiguous()):
                op.replay(view)            # an op reads it or writes part: the values, as drawn
