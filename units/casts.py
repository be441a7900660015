"""Casts at unit boundaries — stage: units (the rule the runtime and the cost model share).

Input: the unit table (`UnitSpec`s, root first) and one torch dtype per unit (its params'
compute dtype). Output: which unit calls which (`caller_of`), the (own, caller) dtype pair
of each unit that casts (`boundary_casts`) and the forward hooks that cast
(`install_boundary_casts`). The runtime installs them on the sharded model
(runtime/casts.py) and explain's activation trace on its meta copy
(analysis/costmodel/flops.py), so the activations explain counts are those the ranks hold.

[Note: casts at unit boundaries]
The rule (FSDP2's `MixedPrecisionPolicy(cast_forward_inputs=True)` with the `output_dtype`
of the caller): a unit computes in its params dtype. Where that differs from the dtype
of the unit that calls it — the unit whose module holds it, else the root unit — its
floating-point forward inputs (args and kwargs, any nesting) are cast to its dtype
before its module runs, and its floating-point outputs are cast back to the caller's
dtype after. Integer and boolean tensors are never cast. A unit of its caller's dtype
casts nothing, so a model of one dtype runs exactly as before. Gradients flow back in
the right dtypes by autograd's own rule for a cast (the gradient of `x.to(d)` is cast
back to x's dtype). A bucket unit's modules each cast. The hooks are the module's own
forward hooks, so they run on every path: the hooks path, the emitted forward's
`rt.run_unit(i, module, ...)` (which calls the module) and the whole-step mode's capture,
and again when activation checkpointing recomputes the unit.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .spec import UnitSpec


def cast_floats(tree, dtype: torch.dtype):
    """Every floating-point tensor in `tree` cast to `dtype`; everything else as it is."""
    def cast(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t
    return tree_map(cast, tree)


def caller_of(units: list[UnitSpec], i: int) -> int:
    """The index of the unit that calls unit i: the one whose module holds unit i's first
    module most closely, else the root (0)."""
    if i == 0 or not units[i].modules:
        return 0
    mod = units[i].modules[0]
    best, depth = 0, -1
    for j, u in enumerate(units):
        if j in (0, i):
            continue
        for m in u.modules:
            if mod.startswith(m + ".") and len(m) > depth:
                best, depth = j, len(m)
    return best


def boundary_casts(units: list[UnitSpec], dtypes) -> list[tuple[torch.dtype, torch.dtype] | None]:
    """Per unit, (its compute dtype, its caller's) where they differ, else None
    ([Note: casts at unit boundaries]). The root has no caller: always None."""
    return [None if i == 0 or dtypes[i] == dtypes[caller_of(units, i)]
            else (dtypes[i], dtypes[caller_of(units, i)]) for i in range(len(units))]


def install_boundary_casts(model: nn.Module, units: list[UnitSpec], dtypes) -> list:
    """Forward hooks casting each boundary of units of different dtypes; returns the handles."""
    handles = []
    for u, cast in zip(units, boundary_casts(units, dtypes)):
        if cast is None:
            continue
        own, caller = cast
        for name in u.modules:
            m = model.get_submodule(name)

            def pre(mod, args, kwargs, own=own):
                return cast_floats(args, own), cast_floats(kwargs, own)

            def post(mod, args, kwargs, out, caller=caller):
                return cast_floats(out, caller)

            # prepend: the cast happens before the engine's own hooks see the inputs, and
            # the outputs are cast before the engine arms the backward on them
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True, prepend=True))
    return handles
