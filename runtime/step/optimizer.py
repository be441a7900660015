"""Optimizers over a sharded model — stage: runtime.

Input: torch.optim optimizers whose parameters are a ShardedModule's `ShardParam`s
(runtime/state/params.py): built by `sm.optimizer(cls, param_groups, **kw)` or by the user
(`torch.optim.AdamW(sm.parameters(), ...)`), the same thing either way.
Output: the optimizer adopted: its step waits the step's gradient sync first and issues
the update all-gathers after, its state dict speaks checkpoint pieces
(runtime/state/checkpoint.py); `build_optimizer` makes the one `sm.optimizer` returns.

[Note: adoption through torch's optimizer hooks]
A ShardedModule owns no optimizer class: each optimizer over its parameters is a plain
torch optimizer, adopted through torch's global step hooks
(`register_optimizer_step_pre_hook` / `_post_hook`, installed once per process). At an
optimizer's first step (or when `sm.optimizer` builds it) the hook finds which
ShardedModules own its parameters, refuses an optimizer that is not element-wise over
sharded optimizer states, and registers the checkpoint hooks on it. Then each step:
before it, the owners' gradient sync completes and the parameters' gradients become plain
views (no per-op dispatch in the update); after it, if it consumed shardc's gradients,
the update all-gathers go out (`StepBoundary.optimizer_stepped`: once per step, after the
last optimizer to step a parameter holding shardc's gradients, [Note: one step, several optimizers]). A step whose gradients are not
shardc's (torch's `_init_optim_state` steps once on zero gradients with lr 0 to create the
state before a checkpoint is read or written) moves no parameter and records nothing.
Zeroing is torch's own `zero_grad()` (runtime/state/params.py [Note: gradients]).

[Note: element-wise only]
Sharding optimizer state is exact only for updates that act element by element (each
element's new value depends on its own grad and state). LBFGS, Adafactor-style factored
moments and anything not in `ELEMENTWISE` are refused on a parameter whose piece is a flat
chunk, in one sentence naming it and the tensor-owned scope; they run on parameters whose
piece is whole (optim `replicate`, s_OS = 1) and on matrices whose optim scope is `by
tensor` (runtime/step/owned.py: the owner steps each whole matrix). An element-wise
optimizer over tensors a by-tensor scope owns (its norms and biases) steps them whole on
their owners the same way, and the rest of its parameters on their chunks.
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import (_foreach_supported_types, register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from shardc.lowering.optimizers import OPTIMIZER_KINDS

from . import owned, owned_state
from ..errors import RuntimeUsageError
from ..state.checkpoint import attach_optimizer_hooks
from ..state.params import ShardParam

ELEMENTWISE = tuple(getattr(torch.optim, n) for n, k in OPTIMIZER_KINDS.items() if k.elementwise)
_installed = False


def install() -> None:
    """torch's global step hooks (once per process) and ShardParam in the foreach types."""
    global _installed
    if _installed:
        return
    register_optimizer_step_pre_hook(_pre_step)
    register_optimizer_step_post_hook(_post_step)
    if ShardParam not in _foreach_supported_types:
        _foreach_supported_types.append(ShardParam)       # as DTensor registers itself
    _installed = True


def _mine(opt) -> tuple:
    """(param set, its parameters in this optimizer) per ShardedModule owning any of them,
    read from the optimizer's parameters themselves at each step (by identity: a param
    group replaced or added since is seen at once); an optimizer over no ShardParam gets ()
    and is left alone. A set adopts an optimizer once (its `optimizers`, weakly): the
    element-wise check and the checkpoint hooks ([Note: adoption through torch's optimizer hooks])."""
    sets: dict[int, tuple] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            if isinstance(p, ShardParam):
                sets.setdefault(id(p._shardc_set), (p._shardc_set, []))[1].append(p)
    owners = tuple((s, tuple(ps)) for s, ps in sets.values())
    fresh = [s for s, _ in owners if not any(o() is opt for o in s.optimizers)]
    for s, ps in owners:
        whole = type(opt) not in ELEMENTWISE             # steps views of whole pieces too
        if s in fresh and _check_cls(type(opt), s, ps) and owned.adopt(opt, s, ps, views=whole):
            owned_state.attach(opt)
    if fresh and len(fresh) == len(owners):        # the optimizer's first adoption: its hooks once
        attach_optimizer_hooks(opt)
        for s in fresh:
            s.optimizers.append(weakref.ref(opt))
    return owners


def _pre_step(opt, args, kwargs) -> None:
    consumed = False
    for s, params in _mine(opt):
        if any(s.ours(p) for p in params):        # not torch's state-creating step on zeros
            s.require("opt.step()")
            consumed = True
        s.boundary.wait_sync("opt.step()")
        s.settle("opt.step()")
        s.plain_grads(params)
    owned.before(opt, consumed)


def _post_step(opt, args, kwargs) -> None:
    owned.after(opt)
    for s, params in _mine(opt):
        consumed = any(s.ours(p) for p in params)
        s.shard_grads(params)
        if consumed:
            s.boundary.optimizer_stepped([p._shardc_spec.name for p in params], _others_due(s))


def _others_due(pset):
    """Is a parameter of `pset` holding this step's gradient not stepped yet
    (runtime/step/boundary.py [Note: one step, several optimizers])?"""
    return lambda stepped: any(n not in stepped and pset.ours(p) for n, p in pset.params.items())


def _check_cls(cls, pset, params) -> bool:
    """Whether `cls` steps whole tensors (runtime/step/owned.py): one that is not element-wise,
    over matrices whose optim scope is by tensor or over whole pieces; an element-wise one
    over any tensor a by-tensor scope owns (lowering/owned.py [Note: the element-wise
    remainder is owned too]), else it runs on the chunks (False). One that is not
    element-wise is refused on a flat chunk in one sentence naming the tensor-owned scope."""
    owners = owned.owned_names(pset)
    if cls in ELEMENTWISE:
        return any(p._shardc_spec.name in owners for p in params)
    flat = [p for p in params if p._shardc_spec.name not in owners and not p._is_whole]
    if flat:
        name = flat[0]._shardc_spec.name
        raise RuntimeUsageError(
            f"{getattr(cls, '__name__', cls)} is not an element-wise optimizer, so it cannot "
            f"run on sharded optimizer states ({name!r} is a flat chunk over "
            f"{', '.join(flat[0]._shardc_spec.levels)}); place its 2-D parameters' states by tensor "
            f"(`optim shard over LEVELS by tensor`, each matrix whole on one owner), use one of "
            f"{', '.join(c.__name__ for c in ELEMENTWISE)}, or 'optim replicate'")
    return True


def build_optimizer(pset, aliases: dict[str, str], frozen: set[str], cls,
                    param_groups=None, **kw) -> torch.optim.Optimizer:
    """`sm.optimizer`: `cls` over the trainable parameters, `param_groups` naming them
    (original names, aliases allowed); the rest go in a last group of their own."""
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
    for name, p in pset.params.items():
        if name in frozen:
            continue
        (groups[wanted[name]] if name in wanted else default)["params"].append(p)
    opt = cls(groups + ([default] if default["params"] or not groups else []), **kw)
    install()
    _mine(opt)
    pset.owned.append(opt)           # sm.optimizer's: the module keeps it (memory_report counts it)
    return opt
