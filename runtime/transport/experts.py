"""Expert parallelism — stage: runtime. The experts' mesh and their DTensor parameters: the
runtime of the experts' placement kind (lowering/experts.py), on a mesh of its own
(runtime/groups/placed.py [Note: a kind on a mesh of its own]).

Input: the mesh shardc shards over (`ShardMesh`), the strategy's experts
(`shardc.lowering.ExpertGroup`: pattern, ep, the level ep borrows from, the experts' mesh)
and the model's parameters. Output: `ExpertRuntime` (None with ep 1: the experts stay on the
strategy's mesh): the experts' `ShardMesh` (the ranks ep leaves, its levels named as the
strategy's), this rank's ep group, and a `TPParam` per expert parameter, validated (one
sentence naming the culprit otherwise).

[Note: the experts' process groups]
ep borrows the innermost `ep` ranks of its level (all of them for a whole level). Every
rank lays the data-parallel DeviceMesh's rank tensor out as (ep, *levels), that level's
size divided by ep, and builds one DeviceMesh of it (the same tensor on every rank, so
every rank makes the same group calls); its slice over the strategy's levels is the
experts' data-parallel mesh, on which their flat groups run their rows. Its `shardc_ep`
dim is the ep group the strategy implies: each expert DTensor's mesh must hold exactly
those ranks, in that order (an ep over the wrong ranks, or over another level, is refused).
The DeviceMesh is made once per (mesh, ep) in a process, like `ShardMesh`.

[Note: expert gradients are averaged over the whole data-parallel degree]
An expert's local gradient already sums what the tokens of every rank of its ep group
contributed (the dispatch's all-to-all carries them back), so its flat group
reduce-scatters over the experts' mesh only and divides by the whole data-parallel world,
as for a dense parameter. Dividing by the experts' mesh instead would scale them by ep
(pytorch/pytorch#160285, torchtitan#1551).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardc.dsl.errors import ShardcError
from shardc.lowering import ExpertGroup, is_expert

from .mesh import ShardMesh
from ..state.dtensor_params import TPParam

EP_DIM = "shardc_ep"


class ExpertRuntime(NamedTuple):
    """The experts' side of a ShardedModule (see the module notes)."""
    smesh: ShardMesh                   # the experts' data-parallel mesh
    ep_ranks: tuple[int, ...]          # this rank's ep group (global ranks, ep order)
    params: dict                       # canonical name -> TPParam (Shard(0) on the ep mesh)

    @property
    def no_init(self) -> str:
        """Why shardc's init does not give the experts their values (each rank holds other experts)."""
        return ("a model on the meta device with ep > 1 is not initialized by shardc yet: build it with values "
                "(each rank's experts placed by its ExpertParallel), or pass init=False and load it")


def expert_runtime(smesh: ShardMesh, experts: ExpertGroup, params: dict) -> ExpertRuntime | None:
    """The experts' mesh and parameters (see the module notes); None for ep 1 (the
    strategy's mesh, plain tensors)."""
    if experts.ep == 1:
        return None
    full, esmesh = _meshes(smesh, experts)
    ep_ranks = tuple(full[EP_DIM].mesh.flatten().tolist())
    out = {}
    for name, p in params.items():
        if is_expert(experts, name):
            out[name] = _expert_param(name, p, experts, ep_ranks)
    if not out:
        raise ShardcError(f'the strategy\'s experts pattern "{experts.pattern}" with ep {experts.ep} matches no '
                          f'parameter of the model; name the module holding the experts (e.g. "*.experts")')
    return ExpertRuntime(esmesh, ep_ranks, out)


def ep_device_mesh(smesh: ShardMesh, experts: ExpertGroup) -> DeviceMesh:
    """This rank's 1-D ep DeviceMesh (dim `shardc_ep`): the mesh its expert DTensors must be
    on ([Note: the experts' process groups]); `shardc simulate` hands it to the factory."""
    return _meshes(smesh, experts)[0][EP_DIM]


def _meshes(smesh: ShardMesh, experts: ExpertGroup) -> tuple[DeviceMesh, ShardMesh]:
    """The ep x data-parallel DeviceMesh and the experts' ShardMesh, made once per `smesh`
    (kept on it: runtime/transport/mesh.py `ShardMesh.derived`)."""
    return smesh.derived(("experts", experts.mesh, experts.level, experts.ep), lambda: _make(smesh, experts))


def _make(smesh: ShardMesh, experts: ExpertGroup) -> tuple[DeviceMesh, ShardMesh]:
    dm = smesh.device_mesh
    if dm.size() != dist.get_world_size():
        raise ShardcError(f"ep {experts.ep} needs the DeviceMesh shardc shards over to hold every rank of the job "
                          f"({dm.size()} of {dist.get_world_size()} here); expert parallelism beside tensor or "
                          f"other parallelism is not supported yet")
    names = smesh.mesh.names
    i = names.index(experts.level)
    t = dm.mesh
    shape = list(t.shape)
    t = t.reshape(shape[:i] + [shape[i] // experts.ep, experts.ep] + shape[i + 1:]).movedim(i + 1, 0)
    full = DeviceMesh(smesh.device_type, t.contiguous(), mesh_dim_names=(EP_DIM, *names))
    esmesh = ShardMesh(experts.mesh, smesh.device_type, full[names])
    return full, esmesh


def _expert_param(name: str, p: torch.Tensor, experts: ExpertGroup, ep_ranks: tuple[int, ...]) -> TPParam:
    """A validated expert parameter: a DTensor placed Shard(0) on a 1-D mesh of this rank's ep group."""
    where = f"with `ep {experts.ep}` the experts of this rank's ep group live on ranks {list(ep_ranks)} " \
            f"(the innermost ranks of level `{experts.level}`)"
    if not isinstance(p, DTensor):
        raise ShardcError(f"expert parameter {name!r} is a plain tensor, but {where}: place it as DTensor "
                          f"Shard(0) on an ep mesh of those ranks (e.g. examples/moe.py's ExpertParallel)")
    ranks = tuple(p.device_mesh.mesh.flatten().tolist())
    dims = tuple(p.device_mesh.mesh_dim_names or ())
    if p.device_mesh.ndim != 1 or ranks != ep_ranks:
        raise ShardcError(f"expert parameter {name!r} is a DTensor on mesh {dims} over ranks {list(ranks)}, but "
                          f"{where}; build the ep dim from the data-parallel ranks, innermost and contiguous "
                          f"(torchtitan's order), or change `ep` to match it")
    if tuple(p.placements) != (Shard(0),):
        raise ShardcError(f"expert parameter {name!r} is placed as {tuple(p.placements)} on the ep mesh; shardc "
                          f"takes experts split along dim 0 (Shard(0))")
    local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return TPParam(p.device_mesh, tuple(p.placements), tuple(p.shape), tuple(p.stride()), tuple(local_shape),
                   tuple(offset))
