"""Initialization on shards — stage: runtime (state). A model built on the meta device gets
its values module by module, straight into this rank's shards.

Input: the model (parameters and buffers on the meta device), a function called per module
(`init=`; default: the module's own `reset_parameters()` where it has one), where each
parameter lives (`places`: parameter object id -> the writes that keep its shard) and the
device. Output: the shards written; buffers materialized on the device and left in the
model; the names of parameters no call gave a value (`unset`).

[Note: the same values on every world size]
The values are those of `model.to_empty(device=d); model.apply(fn)` in one process, with
the RNG as it was when sharding began (`rng_state`), element for element, whatever the
world size, mesh or strategy: every rank runs `fn` on every module, in `nn.Module.apply`'s
order (children first, then the module itself), so every random draw happens in the same
order on every rank as in the single process; what differs is what a rank keeps. A
module's own parameters and buffers are materialized right before `fn` runs on it (a
parameter shared by several modules once, the same tensor for each, as in the model);
after the last module holding a parameter has run, each rank copies the parts of it
inside its chunks into its shards (`FlatStorage.write_param`) and the whole tensor is
dropped. So no rank holds more than the parameters of the modules being initialized: one
module's, plus a tied parameter until its last holder. A parameter is materialized as
NaN: one that is still all NaN after every call has no value (no `fn` touched it) and is
reported in `unset`. The price of world-independence is that every rank computes every
value: initializing costs each rank what initializing the whole model costs one process.
So this loop runs on every rank only where the first rank cannot send the values (a
data-parallel group smaller than the world, DTensor parameters, `buffers_only`);
otherwise the first rank alone runs it and sends each rank its chunks
(init_first.py, [Note: one rank draws, every rank receives]; docs/checkpoints.md).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardc.dsl.errors import ShardcError


class BuffersOnly:
    """`init=shardc.buffers_only(fn)`: `fn` runs per module with the parameters left on the
    meta device (no values, no random draws: a load gives them), so only buffers get values —
    Hugging Face's `model._init_weights` recomputing rotary caches before a checkpoint loads."""

    def __init__(self, fn):
        if not callable(fn):
            raise ShardcError(f"buffers_only takes a function called per module, not {type(fn).__name__}")
        self.fn = fn

    def __call__(self, module: nn.Module) -> None:
        self.fn(module)


def reset_parameters(module: nn.Module) -> None:
    """The default init: a module's own `reset_parameters()`, where it has one."""
    fn = getattr(module, "reset_parameters", None)
    if callable(fn):
        fn()


def apply_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) in the order `model.apply(fn)` calls fn: children first."""
    out = []

    def visit(path: str, m: nn.Module) -> None:
        for name, c in m.named_children():
            visit(f"{path}.{name}" if path else name, c)
        out.append((path, m))
    visit("", model)
    return out


def _empty_like(p: torch.Tensor, device: torch.device, fill: float | None) -> torch.Tensor:
    """A real tensor of meta tensor p's shape and dtype on `device` (a DTensor's local shard
    for a DTensor), filled with `fill` when given."""
    if isinstance(p, DTensor):
        local = torch.empty(p.to_local().shape, dtype=p.dtype, device=device)
        if fill is not None:
            local.fill_(fill)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    t = torch.empty(p.shape, dtype=p.dtype, device=device)
    return t.fill_(fill) if fill is not None else t


@contextlib.contextmanager
def rng(state):
    """The RNG as it was when sharding began (`state`: (cpu, {cuda device: state})); None:
    as it is."""
    if state is not None:
        cpu, cuda = state
        torch.random.set_rng_state(cpu)
        for dev, st in cuda.items():
            torch.cuda.set_rng_state(st, dev)
    yield


def rng_state():
    """The RNG state to initialize from: the CPU generator and every initialized CUDA device's."""
    cuda = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = {d: torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())}
    return torch.random.get_rng_state(), cuda


def initialize(model: nn.Module, fn, places: dict[int, list], names: dict[int, str],
               device: torch.device, state=None) -> set[str]:
    """Run `fn` on every module in apply order, keeping shards (see Note). `places[id(p)]`:
    callables writing parameter p's whole value into this rank's shards; `names[id(p)]`: its
    canonical name. Returns the names of parameters left without a value (all of them under
    `BuffersOnly`)."""
    params_too = not isinstance(fn, BuffersOnly)
    order = apply_order(model)
    last = {}
    for i, (_, m) in enumerate(order):
        for p in m._parameters.values():
            if p is not None:
                last[id(p)] = i
    real: dict[int, nn.Parameter] = {}         # meta parameter id -> its materialized tensor
    holders: dict[int, list] = {}              # meta parameter id -> [(module, attr)] swapped
    unset: set[str] = set()
    with rng(state):
        for i, (path, m) in enumerate(order):
            with torch.no_grad():
                _materialize(m, device, real, holders, params_too)
            try:
                fn(m)                              # as model.apply(fn) calls it
            except Exception as e:                 # noqa: BLE001 — named, then re-raised
                raise ShardcError(f"init function {getattr(fn, '__name__', fn)!r} failed on module "
                                  f"{path or '<root>'} ({type(m).__name__}): {type(e).__name__}: {e}") from e
            with torch.no_grad():
                for pid in [pid for pid in real if last[pid] == i]:
                    _keep(real.pop(pid), places.get(pid, ()), names[pid], unset)
                    for mod, attr, meta in holders.pop(pid):
                        mod._parameters[attr] = meta
    return unset if params_too else set(names.values())


# Elements per block of the all-NaN check ([Note: no whole-parameter mask]).
NAN_BLOCK = 1 << 20


def _keep(value: torch.Tensor, writes, name: str, unset: set[str]) -> None:
    """A parameter's final value into this rank's shards; still all NaN: it has none."""
    local = value.to_local() if isinstance(value, DTensor) else value
    if local.is_floating_point() and all_nan(local):
        unset.add(name)
    for write in writes:
        write(local)


def all_nan(t: torch.Tensor) -> bool:
    """Every element NaN (a parameter no call gave a value): one element decides most; the
    rest is read in blocks of NAN_BLOCK elements, stopping at the first block with a value.

    [Note: no whole-parameter mask]
    `torch.isnan(t).all()` makes a bool mask of the whole tensor first: a quarter of an fp32
    parameter's bytes, beside the parameter itself, at start-up's peak (the largest unit's
    whole parameters: 62.5 MiB beside the 250 MiB embedding of a 32000 x 2048 Llama, measured
    with torch's MemTracker on 8 gloo ranks, bench/peak_fsdp2.py --layers). In blocks the
    mask is at most NAN_BLOCK bytes, and a parameter that got values stops at its first."""
    flat = t.reshape(-1)
    if not flat.numel() or not bool(torch.isnan(flat[0])):
        return False
    return all(bool(torch.isnan(b).all()) for b in flat.split(NAN_BLOCK))


def _materialize(m: nn.Module, device, real: dict, holders: dict, params: bool) -> None:
    """m's own parameters (`params`) and buffers on `device` in place of meta tensors, NaN
    where floating (what still is all NaN after init never got a value)."""
    for attr, p in list(m._parameters.items()):
        if p is None or not params:
            continue
        key = id(p) if p.is_meta else None
        if key is None:
            continue
        if key not in real:
            fill = float("nan") if p.is_floating_point() else None
            real[key] = nn.Parameter(_empty_like(p, device, fill), requires_grad=p.requires_grad)
            holders[key] = []
        holders[key].append((m, attr, p))
        m._parameters[attr] = real[key]
    materialize_buffers(m, device, recurse=False)


def materialize_buffers(model: nn.Module, device, recurse: bool = True) -> None:
    """Meta buffers as real tensors on `device`: NaN where floating (not yet given a value)."""
    for m in (model.modules() if recurse else (model,)):
        for attr, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[attr] = _empty_like(b, device, float("nan") if b.is_floating_point() else 0)


def unset_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Floating buffers still all NaN (materialized here, never given a value), by name."""
    return {n: b for n, b in model.named_buffers() if b.is_floating_point() and b.numel()
            and not b.is_meta and bool(torch.isnan(b).all())}
