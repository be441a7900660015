"""Memory report and state dicts — stage: runtime.

Input: a `ShardedModule` (its engine's flat groups, its optimizer).
Output: `memory_report()` measured from the tensors actually held (docs/internals.md
"Memory"), `full_state_dict()` (the original model's `state_dict()` keys: parameters
under every name, tied aliases included, and persistent buffers), `full_optim_state_dict()` (torch's optimizer layout keyed by names, full
shapes); `load_full_state_dict()` is `load_state_dict()` on full tensors. Sharded, strategy-independent state dicts for DCP
live in runtime/checkpoint.py. The gathers made here are not training collectives and
are not recorded in the ledger (like the initial broadcast).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .checkpoint import OPTIM_CLASS


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def memory_report(engine, optimizer) -> dict[str, int]:
    rep = {"params": 0, "params_secondary": 0, "grads": 0, "optim": 0}
    for u in engine.units:
        for st in (g.storage for g in u.groups):
            rep["params"] += _nbytes(st.shard)
            rep["params_secondary"] += _nbytes(st.secondary)
            if st.trainable:
                rep["grads"] += _nbytes(st.grad_shard)
                if st.master_separate:
                    rep["optim"] += _nbytes(st.master)
    if optimizer is not None:
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    rep["optim"] += _nbytes(v)
    rep["total"] = sum(rep.values())
    return rep


def _gather(sm, st, local: torch.Tensor, levels, order) -> torch.Tensor:
    """The group's full flat buffer from this rank's chunk over `levels` (unrecorded)."""
    if st.plan.s(levels) == 1:
        return local.clone()
    out = torch.empty(st.n, dtype=local.dtype, device=local.device)
    return sm.comm.gather(out, local.contiguous(), levels, order)


def _global(sm, slot, local: torch.Tensor) -> torch.Tensor:
    """A parameter-shaped tensor on this rank as the global tensor: a DTensor parameter's
    local shard all-gathered over its tp mesh (every tp rank calls it), else itself."""
    tp = sm.tp.get(slot.fqn)
    return tp.full(local.contiguous()) if tp is not None else local


def full_state_dict(sm, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    sm.faults.enter("full_state_dict()")
    sm.buffer_sync.settle()
    keep = not rank0_only or dist.get_rank() == 0
    values: dict[str, torch.Tensor] = {}
    for u in sm.runtime.units:
        for st in (g.storage for g in u.groups):
            full = _gather(sm, st, st.shard, st.plan.p, st.plan.order("params"))
            for s in st.layout.slots:
                value = _global(sm, s, full[s.offset:s.offset + s.numel].view(s.shape))
                if keep:
                    values[s.fqn] = value.clone()
    if not keep:
        return {}
    bufs = dict(sm.module.named_buffers(remove_duplicate=False))
    return {k: values[sm.aliases[k]] if k in sm.aliases else bufs[k].detach().clone()
            for k in sm.state_keys}


def full_optim_state_dict(sm, opt, rank0_only: bool = False) -> dict:
    """{"state": {name: {key: full tensor | scalar}}, "param_groups": [... names ...]}."""
    sm.faults.enter("full_optim_state_dict()")
    keep = not rank0_only or dist.get_rank() == 0
    by_param = {id(p): piece for piece, p in zip(opt.shardc_pieces, opt.shardc_params)}
    state: dict[str, dict] = {}
    for u in sm.runtime.units:
        if u.trainable is None:
            continue
        g = u.trainable.storage
        mine = [(piece, p) for piece, p in zip(opt.shardc_pieces, opt.shardc_params)
                if piece.unit == u.index]
        keys = sorted({k for _, p in mine for k, v in opt.state.get(p, {}).items()
                       if isinstance(v, torch.Tensor) and v.dim() > 0})
        for key in keys:
            local = torch.zeros(g.os_len, dtype=torch.float32, device=g.master.device)
            for piece, p in mine:
                v = opt.state.get(p, {}).get(key)
                if v is not None:
                    local[piece.start - g.os_start:piece.stop - g.os_start].copy_(v)
            full = _gather(sm, g, local, g.plan.os, g.plan.order("optim"))
            for s in g.layout.slots:
                value = _global(sm, s, full[s.offset:s.offset + s.numel].view(s.shape))
                state.setdefault(s.fqn, {})[key] = value.clone()
        for piece, p in mine:
            for k, v in opt.state.get(p, {}).items():
                if not (isinstance(v, torch.Tensor) and v.dim() > 0) and piece.stop > piece.start \
                        and not piece.name.startswith("<padding>"):
                    state.setdefault(piece.name, {})[k] = v.clone() if isinstance(v, torch.Tensor) else v
    state = _agree_scalars(state, sm.comm.smesh.dp_group())
    if not keep:
        return {}
    groups = []
    for pg in opt.param_groups:
        names = [by_param[id(p)].name for p in pg["params"] if p.requires_grad]
        groups.append({**{k: v for k, v in pg.items() if k != "params"}, "params": names,
                       OPTIM_CLASS: type(opt).__name__})
    return {"state": {n: state[n] for g in groups for n in g["params"] if n in state},
            "param_groups": groups}


def _agree_scalars(state: dict, group) -> dict:
    """Scalar states (step counts) of parameters this rank holds no piece of come from the
    ranks that do (all-gathered objects; every piece steps together)."""
    if group is None:
        return state
    got = [None] * dist.get_world_size(group)
    scalars = {n: {k: v for k, v in st.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
               for n, st in state.items()}
    dist.all_gather_object(got, scalars, group=group)
    for other in got:
        for n, st in other.items():
            for k, v in st.items():
                state.setdefault(n, {}).setdefault(k, v)
    return state

