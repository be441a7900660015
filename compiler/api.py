"""The compiler pipeline end to end (`shardc compile`; `shardc.compile` runs its text).

Input: a model, a strategy (an `ir.Strategy`, a path or the text), optional example
inputs, a capture mode and a mesh override. Output: `compile_source` gives the emitted
module's text and its Plan; `shardc.api.compile_model` (the public API's layer, which
may import the runtime) executes that text and returns `shard_model(model,
lowering=plan.lowering)`.

Pipeline: strategy -> bucket size resolved (cost model) -> units -> collectives resolved
(cost model) -> capture -> graph passes -> Plan (with the lowering) -> codegen.

[Note: stage names]
The compiler's stages go by name (`units`, `capture`, `graph passes`, `plan`, `codegen`;
the graph passes are numbered 1-4 among themselves); the numbered stages 1-3 are the
strategy pipeline's: parse (text -> AST) and resolve (AST -> Strategy) in dsl/, lower
(Strategy + unit sizes -> Lowering) in lowering/, which the `plan` stage calls.
"""
from __future__ import annotations

import dataclasses
import os
import time
from math import prod

from torch import nn

from shardc.analysis.costmodel.bucketing import resolve_bucket
from shardc.analysis.costmodel.sizes import model_unit_sizes
from shardc.compiler.capture import capture as capture_graph
from shardc.compiler.codegen import emit
from shardc.compiler.passes import run_passes
from shardc.compiler.plan import Plan, build_plan
from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Collectives, MeshDims, Strategy
from shardc.dsl.unparse import unparse
from shardc.lowering import kinds_of
from shardc.units import find_units

__all__ = ["compile_source", "resolve_strategy"]


def resolve_strategy(strategy, mesh=None, world_size: int | None = None) -> Strategy:
    """An `ir.Strategy` from a Strategy, a path or text (mesh override applied; a DeviceMesh
    binds the strategy's levels to its dims, dsl/mesh.py [Note: binding to a DeviceMesh])."""
    mesh = _mesh_dims(mesh)
    if isinstance(mesh, MeshDims):
        world_size = prod(mesh.sizes)
        if isinstance(strategy, Strategy):
            strategy = unparse(strategy)
    if isinstance(strategy, Strategy):
        if mesh is None:
            return strategy
        from shardc.dsl import parse_mesh_text
        m = parse_mesh_text(mesh) if isinstance(mesh, str) else mesh
        return dataclasses.replace(strategy, mesh=m)
    if not isinstance(strategy, (str, os.PathLike)):
        raise ShardcError(f"strategy must be a Strategy, a path or the text of a .shard file, "
                          f"not {type(strategy).__name__}")
    if world_size is None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
    from shardc.dsl import load_strategy
    return load_strategy(os.fspath(strategy), world_size=world_size, mesh=mesh)


def _mesh_dims(mesh):
    """A DeviceMesh as the dims the strategy binds to; anything else as it is."""
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(mesh, DeviceMesh):
        return MeshDims(tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.shape))
    return mesh


def _resolve_collectives(strategy: Strategy, model: nn.Module, units) -> Strategy:
    """`collectives auto` -> the cost model's choice for these unit sizes."""
    if strategy.collectives is not Collectives.AUTO:
        return strategy
    from shardc.analysis.costmodel.timing import choose_collectives
    sizes = model_unit_sizes(model, units, kinds_of(strategy))
    return dataclasses.replace(strategy, collectives=choose_collectives(strategy, sizes))


def compile_source(model: nn.Module, strategy, example_inputs=None, capture: str = "auto",
                   mesh=None, world_size: int | None = None, passes=None,
                   backend: str = "eager", clock: dict | None = None) -> tuple[str, Plan]:
    """The emitted module's source text and the Plan it came from; `passes` names the
    plan passes to run (None: all of `shardc.lowering.passes.PLAN_PASSES`); `backend` the
    runtime the module shards for ("inductor": the whole-step compiled mode); `clock`, a
    dict, gets the wall seconds of `capture_s` (units and capture) and `lowering_s` (graph
    passes, the plan with its `Lowering`, codegen)."""
    t = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise ShardcError(f"shardc.compile needs an nn.Module, got {type(model).__name__}")
    strategy, passes = _for_backend(resolve_strategy(strategy, mesh, world_size), passes, backend)
    strategy = resolve_bucket(model, strategy)
    units = find_units(model, strategy)
    strategy = _resolve_collectives(strategy, model, units)
    gm = capture_graph(model, units, example_inputs, capture)
    t1 = time.perf_counter()
    gm = run_passes(gm, strategy)
    plan = build_plan(gm, strategy, model, passes, backend)
    source = emit(plan, gm, type(model).__name__)
    if clock is not None:
        clock.update(capture_s=t1 - t, lowering_s=time.perf_counter() - t1)
    return source, plan


def _for_backend(strategy: Strategy, passes, backend: str):
    """What the whole-step mode (`backend="inductor"`) plans: every plan pass, as the eager
    runtime (runtime/graph/sync.py, runtime/graph/step.py), and one module per unit (`bucket 0`)."""
    if backend not in ("eager", "inductor"):
        raise ShardcError(f"backend must be 'eager' or 'inductor', got {backend!r}")
    if backend == "eager":
        return strategy, passes
    if strategy.bucket:
        where = f"{strategy.file}:{strategy.line_of('bucket')}: " if strategy.line_of("bucket") else ""
        raise ShardcError(f"{where}backend='inductor' runs one module per unit, but the strategy buckets units "
                          f"up to {strategy.bucket:,} bytes; write `bucket 0`, or use the eager runtime "
                          f"(backend='eager')")
    return dataclasses.replace(strategy, bucket=0), passes
