"""Block reuse — part of compiler stage `capture` (export): trace each distinct block once.

Input: the model, its unit modules (the leaves of the unit table). Output: a context in
which `torch.export` traces the first of each group of identical unit modules and stands
one opaque node in for every later call of an identical one; `count` says how many.

[Note: capture once per block]
An 80-layer model is 80 copies of one block, and `torch.export` of a Hugging Face model
spends its time running each block's Python once per layer. Two unit modules are
identical here when they have the same class and the same parameters and buffers (names,
shapes, dtypes, requires_grad), and a call of one is identical to an earlier call of the
other when their inputs are (the tree of arguments; each tensor's shape, stride and
dtype; every other value's type, and its value when it is a number, string or None).
The first such call is traced as usual and its output recorded (its tree, each tensor's
shape, stride and dtype); every later identical call is one node of the custom op
`shardc::reused_block`, whose inputs are the call's tensors and whose outputs have the
recorded shapes, so the rest of the model traces on as before. A block whose output
holds anything but tensors and None is never stood in for.

Only a unit module is stood in for: all nodes of its call belong to its unit (the
outermost unit on their `nn_module_stack`), so the one node gives the same region, the
same unit order and so the same Plan and `Lowering` (tests/test_capture_reuse.py compares
them byte for byte). The graph itself is only read for its regions: the runtime runs the
model's own forward.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["reused_blocks", "Reuse"]

_RECORDS: list[tuple[str, tuple]] = []     # record id -> (device, ((shape, stride, dtype), ...))


@torch.library.custom_op("shardc::reused_block", mutates_args=())
def _reused_block(inputs: list[torch.Tensor], record: int) -> list[torch.Tensor]:
    raise RuntimeError("shardc::reused_block stands in for a block during capture only and never runs")


@_reused_block.register_fake
def _(inputs, record):
    device, outs = _RECORDS[record]
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in outs]


class Reuse:
    """What one capture reused: `count` calls stood in for."""

    def __init__(self):
        self.count = 0
        self.records: dict[tuple, object] = {}


_PLAIN = (int, float, bool, str, type(None))


def _module_key(m: nn.Module) -> tuple:
    states = [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in m.named_parameters()]
    states += [(n, tuple(t.shape), t.dtype) for n, t in m.named_buffers()]
    return (type(m), tuple(states))


def _value_key(x) -> tuple:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad)
    if isinstance(x, _PLAIN):
        return (type(x), x)
    return (type(x),)


def _stand_in(m: nn.Module, key: tuple, reuse: Reuse):
    forward = m.forward

    def call(*args, **kwargs):
        flat, spec = tree_flatten((args, kwargs))
        with torch._C.DisableTorchFunction():          # shapes read plainly, not through export's modes
            k = (key, str(spec), tuple(_value_key(x) for x in flat))
        rec = reuse.records.get(k)
        if rec is None:
            out = forward(*args, **kwargs)
            reuse.records[k] = _record(out)
            return out
        if rec is False:                      # an output we cannot stand in for
            return forward(*args, **kwargs)
        rid, out_spec, where = rec
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        made = iter(torch.ops.shardc.reused_block(tensors, rid))
        reuse.count += 1
        return tree_unflatten([next(made) if w else None for w in where], out_spec)
    return call


def _record(out):
    leaves, spec = tree_flatten(out)
    if not all(x is None or isinstance(x, torch.Tensor) for x in leaves):
        return False
    tensors = [x for x in leaves if x is not None]
    if not tensors:
        return False
    _RECORDS.append((str(tensors[0].device), tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors)))
    return len(_RECORDS) - 1, spec, [x is not None for x in leaves]


@contextlib.contextmanager
def reused_blocks(model: nn.Module, leaves: set[str], enabled: bool = True):
    """Within: identical unit modules' later calls stand in for (see the module note)."""
    reuse = Reuse()
    modules = dict(model.named_modules())
    groups: dict[tuple, list[nn.Module]] = {}
    for path in sorted(leaves) if enabled else ():
        if path in modules:
            groups.setdefault(_module_key(modules[path]), []).append(modules[path])
    patched = [(m, m.__dict__.get("forward")) for ms in groups.values() if len(ms) > 1 for m in ms]
    for key, ms in groups.items():
        if len(ms) > 1:
            for m in ms:
                m.forward = _stand_in(m, key, reuse)
    try:
        yield reuse
    finally:
        for m, own in patched:
            if own is None:
                del m.forward
            else:
                m.forward = own
