"""Memory report and state dicts — stage: runtime.

Input: a `ShardedModule` (its engine's flat groups, its optimizer).
Output: `memory_report()` measured from the tensors actually held (docs/internals.md
"Memory"), `full_state_dict()` (original names and shapes, tied aliases included,
buffers), and a sharded `state_dict()` of 1-D DTensors (one per flat group) that
torch.distributed.checkpoint saves and loads, also across strategies whose units have
the same padded sizes. The gathers made here are not training collectives and are not recorded in
the ledger (like the initial broadcast).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .errors import RuntimeUsageError


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def memory_report(engine, optimizer) -> dict[str, int]:
    rep = {"params": 0, "params_secondary": 0, "grads": 0, "optim": 0}
    for u in engine.units:
        for g in u.groups:
            rep["params"] += _nbytes(g.shard)
            rep["params_secondary"] += _nbytes(g.secondary)
            if g.trainable:
                rep["grads"] += _nbytes(g.grad_shard)
                if g.master_separate:
                    rep["optim"] += _nbytes(g.master)
    if optimizer is not None:
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    rep["optim"] += _nbytes(v)
    rep["total"] = sum(rep.values())
    return rep


def _gather_full(sm, g) -> torch.Tensor:
    """The group's full flat values (unrecorded gather over P)."""
    if g.s_p == 1:
        return g.shard.clone()
    out = torch.empty(g.n, dtype=g.shard.dtype, device=g.shard.device)
    comm = sm.comm
    comm.C.all_gather(out, g.shard, comm.smesh, g.plan.p, g.plan.order("params"),
                      algo=comm.algo).wait()
    return out


def full_state_dict(sm) -> dict[str, torch.Tensor]:
    values: dict[str, torch.Tensor] = {}
    for u in sm.runtime.units:
        for g in u.groups:
            full = _gather_full(sm, g)
            for s in g.layout.slots:
                values[s.fqn] = full[s.offset:s.offset + s.numel].view(s.shape).clone()
    out = {name: values[sm.aliases[name]] for name in sm.param_order}
    for name, buf in sm.module.named_buffers():
        out[name] = buf.detach().clone()
    return out


def load_full_state_dict(sm, sd: dict[str, torch.Tensor]) -> None:
    missing = [n for n in sm.param_order if n not in sd and sm.aliases[n] == n]
    missing += [n for n, _ in sm.module.named_buffers() if n not in sd]
    if missing:
        raise RuntimeUsageError(f"load_full_state_dict: missing key {missing[0]!r}")
    with torch.no_grad():
        for u in sm.runtime.units:
            for g in u.groups:
                full = torch.zeros(g.n, dtype=g.shard.dtype, device=g.shard.device)
                for s in g.layout.slots:
                    v = sd[s.fqn]
                    if tuple(v.shape) != s.shape:
                        raise RuntimeUsageError(f"load_full_state_dict: {s.fqn!r} has shape "
                                                f"{tuple(v.shape)}, expected {s.shape}")
                    full[s.offset:s.offset + s.numel].copy_(v.reshape(-1))
                g.shard.copy_(full[g.p_start:g.p_start + g.p_len])
                if g.trainable and g.master_separate:
                    g.master.copy_(sd_master(sd, g, full))
        for name, buf in sm.module.named_buffers():
            buf.copy_(sd[name])


def sd_master(sd, g, full) -> torch.Tensor:
    """fp32 master for the OS chunk, from the full-precision values in `sd`."""
    m = torch.zeros(g.n, dtype=torch.float32, device=full.device)
    for s in g.layout.slots:
        m[s.offset:s.offset + s.numel].copy_(sd[s.fqn].reshape(-1).float())
    return m[g.os_start:g.os_start + g.os_len]


def _key(u, g, what: str) -> str:
    return f"{u.spec.name}/{'params' if g.trainable else 'frozen'}/{what}"


def _dtensor(sm, g) -> DTensor:
    """The group's params shard as a 1-D DTensor of N elements: Shard(0) on the P levels.

    [Note: DTensor placement] Several Shard(0) placements split the tensor mesh dim by
    mesh dim, outermost first — the params chunk order (P's levels in mesh order)."""
    dm = sm.comm.smesh.device_mesh
    placements = [Shard(0) if name in g.plan.p else Replicate() for name in g.plan.mesh.names]
    return DTensor.from_local(g.shard.detach().clone(), dm, placements, run_check=False,
                              shape=torch.Size([g.n]), stride=(1,))


def sharded_state_dict(sm) -> dict[str, torch.Tensor]:
    """Per-group flat params shards as DTensors (DCP can save/load and reshard them
    between strategies whose padded sizes agree), fp32 masters per rank, buffers."""
    out = {}
    rank = sm.comm.rank
    for u in sm.runtime.units:
        for g in u.groups:
            out[_key(u, g, "shard")] = _dtensor(sm, g)
            if g.trainable and g.master_separate:
                out[_key(u, g, f"master.rank{rank}")] = g.master.detach().clone()
    for name, buf in sm.module.named_buffers():
        out[f"buffer/{name}"] = buf.detach().clone()
    return out


def _local(sm, g, value) -> torch.Tensor | None:
    if isinstance(value, DTensor):
        if tuple(value.shape) != (g.n,):
            return None
        value = value.redistribute(placements=_dtensor(sm, g).placements).to_local()
    return value if tuple(value.shape) == tuple(g.shard.shape) else None


def load_sharded_state_dict(sm, sd: dict[str, torch.Tensor]) -> None:
    rank = sm.comm.rank
    with torch.no_grad():
        for u in sm.runtime.units:
            for g in u.groups:
                key = _key(u, g, "shard")
                local = _local(sm, g, sd[key]) if key in sd else None
                if local is None:
                    raise RuntimeUsageError(f"load_state_dict: {key!r} missing or of another "
                                            f"shape (saved with different units or padding?)")
                g.shard.copy_(local)
                if g.trainable and g.master_separate:
                    mkey = _key(u, g, f"master.rank{rank}")
                    if mkey in sd:
                        g.master.copy_(sd[mkey])
                    else:                      # resharded: rebuild the master from the params
                        g.master.copy_(g.shard[g.os_in_p:g.os_in_p + g.os_len].float())
        for name, buf in sm.module.named_buffers():
            buf.copy_(sd[f"buffer/{name}"])
