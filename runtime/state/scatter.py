"""Values from the first rank — stage: runtime (state). Each rank receives its own chunks.

Input: the flat groups' storages, the model on the mesh's first rank holding values (the
other ranks' may be on the meta device: accelerate's `cpu_ram_efficient_loading`), where
each parameter lives, and the data-parallel group. Output: every rank's shards written
with the first rank's values; buffers materialized where they were meta, then broadcast.

[Note: a scatter, not a broadcast of the model]
DDP semantics (every rank starts from the first rank's values) used to be a broadcast of
every parameter: each rank received the whole model, one tensor at a time. Here the first
rank lays out one flat group at a time (the unit's padded buffer, in the params dtype) and
scatters it: each rank receives only its params chunk (N/s_P elements; a replicated group,
s_P = 1, is broadcast, which is what every rank keeps). A rank other than the first never
holds more than its chunks; the first holds the model and one unit's buffer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardc.lowering import RankPlan


def scatter_values(storages, values: dict[str, torch.Tensor] | None, smesh) -> None:
    """`values` (canonical name -> the parameter on the first rank, None elsewhere) into every
    rank's shards of `storages` (every rank, in the same order). Not recorded in the ledger."""
    group = smesh.dp_group()
    me = smesh.rank
    for st in storages:
        full = _laid_out(st, values) if me == 0 else None
        if group is None:
            st.write_chunk(full[st.p_start:st.p_start + st.p_len])
            continue
        if st.s_p == 1:
            buf = full if full is not None else torch.empty(st.n, dtype=st.pdtype, device=st.shard.device)
            dist.broadcast(buf, group=group, group_src=0)
            st.write_chunk(buf)
            continue
        chunks = None
        if full is not None:
            starts = [RankPlan(smesh.mesh, st.plan.scopes, r).chunk("params", st.n)[0]
                      for r in range(smesh.mesh.world)]
            chunks = [full[a:a + st.p_len] for a in starts]
        recv = torch.empty(st.p_len, dtype=st.pdtype, device=st.shard.device)
        dist.scatter(recv, chunks, group=group, group_src=0)
        st.write_chunk(recv)


def _laid_out(st, values) -> torch.Tensor:
    """One flat group's padded buffer from the first rank's parameters (params dtype)."""
    full = torch.zeros(st.n, dtype=st.pdtype, device=st.shard.device)
    for s in st.layout.slots:
        v = values[s.fqn]
        v = v.to_local() if isinstance(v, DTensor) else v
        full[s.offset:s.offset + s.numel].copy_(v.detach().reshape(-1))
    return full
