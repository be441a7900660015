"""Expert-parallel systems (bench stage: `SYSTEM+epN` + an MoE model -> placed experts, a System).

Input: a system with an `+epN` suffix ([Note: system suffixes] in systems.py), the MoE model
(bench/models.py's `moe` preset, examples/moe.py), the cluster shape. Output: the model with
its experts placed on an ep mesh and, for FSDP2, the `System` in torchtitan's layout; the
token all-to-all bytes the experts sent (`a2a_bytes`).

[Note: +ep systems]
`NAME+epN` (`+epgpu`, and `+ep` alike: N = the ranks of a node) places every experts module
of the model with examples/moe.py's `apply_ep` (ExpertParallel: each parameter a DTensor
Shard(0) over a 1-D `ep` mesh, tokens dispatched to the experts' ranks and back by two
all-to-alls per layer and forward) on N consecutive ranks of one node: the world mesh
`init_device_mesh("cpu", (W,), ("world",))` unflattened into (efsdp = W/N, ep = N), ep
innermost (torchtitan's order), as tests/test_expert_parallel.py does. The token all-to-alls
therefore stay on loopback. Every rank reads its own batch (EP splits the experts, not the
data), so the training is the same as without EP.
- `shardc:NAME+epN`: `shardc.compile(model, NAME.shard, mesh=world unflattened into
  (node, gpu))`; the strategy's `experts "*.experts" ep N|gpu` must say the same N (shardc
  refuses a mismatch in one sentence).
- `fsdp2+epN` (= `fsdp2:full+epN`): torchtitan's `apply_fsdp_to_decoder` with `ep_degree`
  N (torchtitan/distributed/fsdp.py): `fully_shard` on each block over the whole
  data-parallel mesh (the 1-D world), with a per-parameter mesh for the experts — its
  `shard_placement_fn` returns `ShardPlacementResult(Shard(0), efsdp mesh info)` for them,
  so each block holds two FSDP parameter groups, the experts sharded over the W/N ranks
  EP leaves — then `fully_shard` on the root. FSDP2 divides each group's reduced gradient
  by its own group's size, but an expert's local gradient already sums the tokens of its
  whole ep group, so over efsdp it must be divided by W, not W/N. torchtitan turns FSDP's
  division off (`disable_fsdp_gradient_division`: `set_gradient_divide_factor(1.0)`) and
  divides the loss by the global token count; the bench keeps the harness's per-rank mean
  loss and sets every FSDP module's divide factor to W instead, the same gradients. With
  sums on the wire (`set_force_sum_reduction_for_comms`): a factor other than the group's
  size is NCCL's PREMUL_SUM otherwise, which gloo does not have.
"""
from __future__ import annotations

import contextlib
import importlib

from torch import nn

from models import block_modules
from peers.system import System, adamw, fsdp2_pending_grad_bytes, state_bytes


def ep_degree(value: str, per_node: int) -> int:
    """`+ep`, `+epgpu` -> the ranks of a node; `+epN` -> N."""
    return per_node if value in ("", "gpu") else int(value)


def ep_meshes(nodes: int, per_node: int, ep: int):
    """(dp mesh (node, gpu), efsdp mesh, ep mesh, the 1-D world mesh they all come from)."""
    from torch.distributed.device_mesh import init_device_mesh
    world_size = nodes * per_node
    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))
    sparse = world._unflatten(0, (world_size // ep, ep), ("efsdp", "ep"))
    return world._unflatten(0, (nodes, per_node), ("node", "gpu")), sparse["efsdp"], sparse["ep"], world


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The model's experts modules (examples/moe.py's `Experts`)."""
    return [m for m in model.modules() if type(m).__name__ == "Experts"]


def place_experts(model: nn.Module, ep_mesh) -> nn.Module:
    """examples/moe.py's `apply_ep`, from the module the model was built from."""
    mod = importlib.import_module(type(model).__module__)
    if not hasattr(mod, "apply_ep") or not experts_modules(model):
        raise ValueError("+ep places the experts of examples/moe.py's MoE (--model moe); this model has none")
    return mod.apply_ep(model, ep_mesh)


def a2a_bytes(model: nn.Module) -> int:
    """Token bytes this rank sent into the experts' all-to-alls so far (forward only: the
    dispatch's and the combine's inputs, `dispatched_bytes` of examples/moe.py); 0 without EP."""
    return sum(getattr(m, "dispatched_bytes", 0) for m in experts_modules(model))


def reset_a2a(model: nn.Module) -> None:
    for m in experts_modules(model):
        if hasattr(m, "dispatched_bytes"):
            m.dispatched_bytes = 0


def local_numels(model: nn.Module) -> tuple[list[int], list[int]]:
    """([Φ_root, Φ_block1 dense, ...], [Φ_block1 experts, ...]): elements per FSDP2 group,
    the experts' as this rank's ep shard holds them (bench/peers/ledgers.py `fsdp2_ep_ledger`)."""
    def numel(params):
        return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    blocks = block_modules(model)
    expert = [{id(p) for e in experts_modules(b) for p in e.parameters()} for b in blocks]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = numel(p for p in model.parameters() if id(p) not in in_blocks)
    dense = [numel(p for p in b.parameters() if id(p) not in ex) for b, ex in zip(blocks, expert)]
    return [root] + dense, [numel(p for p in b.parameters() if id(p) in ex) for b, ex in zip(blocks, expert)]


def fsdp2_ep(model: nn.Module, nodes: int, per_node: int, ep: int):
    """`fsdp2+epN`: torchtitan's FSDP2 layout for EP ([Note: +ep systems])."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    _, efsdp, ep_mesh, world = ep_meshes(nodes, per_node, ep)
    place_experts(model, ep_mesh)
    dense, expert = local_numels(model)          # before FSDP2 shards them further
    dense_info, expert_info = _get_mesh_info(world), _get_mesh_info(efsdp)
    for block in block_modules(model):
        experts = {p for e in experts_modules(block) for p in e.parameters()}

        def placement(p, experts=experts):
            return ShardPlacementResult(Shard(0), expert_info if p in experts else dense_info)
        fully_shard(block, mesh=world, shard_placement_fn=placement)
    fully_shard(model, mesh=world)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(float(nodes * per_node))
            m.set_force_sum_reduction_for_comms(True)

    def micro(i: int, last: bool):
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    opt = adamw(model.parameters())
    return System(f"fsdp2:full+ep{ep}", model, opt, micro, memory=lambda: state_bytes(model, opt),
                  pending=lambda: fsdp2_pending_grad_bytes(model),
                  extra={"mesh": [["node", nodes], ["gpu", per_node]], "ep": ep,
                         "expert_mesh": [["node", nodes], ["gpu", per_node // ep]],
                         "unit_numels": dense, "expert_numels": expert})
