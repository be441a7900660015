"""Full state dicts — stage: runtime (state).

Input: a sharded model's `StateView` (its parameters' pieces, the original model and its
state-dict hooks) and an optimizer over its parameters.
Output: `full_state_dict()` — what the unsharded model's `state_dict()` gives (its hooks
run on the whole tensors: runtime/state/hooks.py), `full_optim_state_dict()` (torch's
optimizer layout keyed by parameter names, whole shapes); `load_full_state_dict()` is
`load_state_dict()` on whole tensors. Sharded, strategy-independent state dicts for DCP
live in runtime/state/checkpoint.py. The gathers made here are not training collectives
and are not recorded in the ledger (like the initial broadcast).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..step.owned_state import as_chunks
from . import StateView, hooks
from .checkpoint import OPTIM_CLASS, parameter_values
from .params import ShardParam
from .pieces import gather


def full_state_dict(v: StateView, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    v.params.require("full_state_dict()")
    v.faults.enter("full_state_dict()")
    v.buffer_sync.settle()
    values = parameter_values(v, None)                # collective: every rank gathers
    if rank0_only and dist.get_rank() != 0:
        return {}
    return hooks.save(v.module, v.targets, values)


def full_optim_state_dict(v: StateView, opt, rank0_only: bool = False) -> dict:
    """{"state": {name: {key: whole tensor | scalar}}, "param_groups": [... names ...]}."""
    v.params.require("full_optim_state_dict()")
    v.faults.enter("full_optim_state_dict()")
    keep = not rank0_only or dist.get_rank() == 0
    state: dict[str, dict] = {}
    with as_chunks(opt):          # tensor-owned states as chunks (runtime/step/owned_state.py)
        for p in (p for g in opt.param_groups for p in g["params"]):
            if not isinstance(p, ShardParam) or p._shardc_set is not v.params:
                continue
            spec, st = p._shardc_spec, opt.state.get(p, {})
            for k in sorted(st):
                value = st[k]
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    value = gather(v.comm, spec, value)    # collective, in the same order on every rank
                elif isinstance(value, torch.Tensor):
                    value = value.clone()
                state.setdefault(spec.name, {})[k] = value
    if not keep:
        return {}
    groups = []
    for pg in opt.param_groups:
        names = [p._shardc_spec.name for p in pg["params"] if isinstance(p, ShardParam) and p.requires_grad]
        groups.append({**{k: x for k, x in pg.items() if k != "params"}, "params": names,
                       OPTIM_CLASS: type(opt).__name__})
    return {"state": {n: state[n] for g in groups for n in g["params"] if n in state},
            "param_groups": groups}
