"""DTensor parameters — stage: runtime. Tensor-parallel parameters inside shardc's units.

Input: the model's parameters, some of them DTensors on other dims of the root DeviceMesh
(torch's `parallelize_module`: ColwiseParallel, RowwiseParallel, SequenceParallel, or
replicated), and the mesh shardc shards over (`ShardMesh`).
Output: `TPParam`, what shardc keeps of each: the DTensor's mesh and placements, its global
shape and stride, and where its local shard sits in the global tensor; `local_tensor`;
`tp_params` (validated, one sentence naming the culprit otherwise).

[Note: the local shard is what shardc shards]
A DTensor parameter enters its unit's flat buffer as its local shard (`to_local()`), so
shardc's padding, rows, ledger and memory are all on local shards, as FSDP2's are for
DP x TP (it shards dim 0 of the TP shard: `_StridedShard` where both shard dim 0; shardc's
flat chunks cut the same local shards, by element range). When a unit is gathered, each
such parameter is set on its module as `DTensor.from_local(view, mesh, placements,
shape=, stride=)` of its view of the full buffer, so the model's TP collectives stay
DTensor's; `from_local`'s backward hands back the local gradient (a Partial gradient of a
replicated parameter is all-reduced over tp by DTensor first), which shardc reduces over
the data-parallel mesh only. State dicts put each piece at its global offset
(`TPParam.offset`), so they show global shapes and any dp x tp layout resumes any other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardc.dsl.errors import ShardcError


@dataclass(frozen=True)
class TPParam:
    """A DTensor parameter as shardc keeps it (see Note)."""
    mesh: DeviceMesh
    placements: tuple
    shape: tuple[int, ...]             # global
    stride: tuple[int, ...]            # global
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]            # the local shard's first element in the global tensor

    @property
    def sharded(self) -> bool:
        """Its shards differ across the tp ranks (else every tp rank holds the same values)."""
        return any(isinstance(p, Shard) for p in self.placements)

    def wrap(self, view: torch.Tensor) -> DTensor:
        return DTensor.from_local(view, self.mesh, self.placements, run_check=False,
                                  shape=torch.Size(self.shape), stride=self.stride)

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every tp rank's local shard (a tp all-gather)."""
        return self.wrap(local).full_tensor()

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local shard of a global tensor."""
        index = tuple(slice(o, o + n) for o, n in zip(self.offset, self.local_shape))
        return full[index]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter's data on this rank: a DTensor's local shard, else the tensor's data."""
    return t.to_local() if isinstance(t, DTensor) else t.data


def tp_params(params: dict[str, torch.Tensor], dp_names: tuple[str, ...], experts=()) -> dict[str, TPParam]:
    """canonical name -> TPParam for every DTensor parameter but the `experts` (expert
    parallelism: runtime/transport/experts.py); every one on one mesh whose dims are not the
    data-parallel levels, placed by Shard or Replicate only."""
    out, mesh = {}, None
    for name, p in params.items():
        if not isinstance(p, DTensor) or name in experts:
            continue
        dims = tuple(p.device_mesh.mesh_dim_names or ())
        shared = [d for d in dims if d in dp_names]
        if shared:
            raise ShardcError(f"parameter {name!r} is a DTensor over dim {shared[0]!r}, which is one of the "
                              f"data-parallel levels shardc shards over; place DTensor parameters on the "
                              f"other dims (e.g. tp) only")
        bad = [pl for pl in p.placements if type(pl) not in (Shard, Replicate)]
        if bad:
            raise ShardcError(f"parameter {name!r} is placed as {bad[0]}; shardc takes DTensor parameters "
                              f"placed by Shard or Replicate (tensor or sequence parallelism)")
        if mesh is not None and p.device_mesh != mesh:
            raise ShardcError(f"parameter {name!r} is a DTensor on mesh {dims}, another parameter on "
                              f"{tuple(mesh.mesh_dim_names or ())}; shardc takes one tensor-parallel mesh "
                              f"(expert parallelism on a second mesh is not supported yet)")
        mesh = p.device_mesh
        local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        out[name] = TPParam(p.device_mesh, tuple(p.placements), tuple(p.shape), tuple(p.stride()),
                            tuple(local_shape), tuple(offset))
    return out


def check_root_dims(dp: DeviceMesh, tp: dict[str, TPParam]) -> None:
    """Every dim of the root DeviceMesh is a data-parallel level or the tensor-parallel
    mesh's: shardc averages gradients over the first and DTensor over the second; over any
    other (context or pipeline parallelism) nothing would, so it is refused. A root whose
    dims were unflattened into the data-parallel mesh (torchtitan's world mesh) is counted
    by its ranks: the data-parallel and tensor-parallel ranks must make all of them."""
    root = dp._get_root_mesh()
    used = set(dp.mesh_dim_names or ()) | {d for t in tp.values() for d in t.mesh.mesh_dim_names or ()}
    extra = [d for d in root.mesh_dim_names or () if d not in used and root.mesh.shape[
        root.mesh_dim_names.index(d)] > 1]
    tp_size = next(iter(tp.values())).mesh.size() if tp else 1
    if extra and dp.size() * tp_size == root.size():
        extra = []
    if extra:
        raise ShardcError(f"the DeviceMesh shardc shards over is part of a mesh with dim {extra[0]!r}, which is "
                          f"neither one of the strategy's levels nor the mesh of a DTensor parameter, so no "
                          f"gradient would be averaged over it; shardc composes with tensor parallelism only "
                          f"(context, pipeline and expert parallelism are not supported yet)")
