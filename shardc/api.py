"""The public API's compile-and-run (`shardc.compile`) — stage: public API (model +
strategy -> a running ShardedModule).

Input: what `shardc.compile` takes. Output: a `ShardedModule`: the compiler pipeline
(`shardc.compiler.api.compile_source`, run on rank 0 only and handed to the others by
`shardc/handoff.py`) gives the emitted module's text and its Plan; this
layer executes the text (`load_emitted`) and calls its `shard_model` with the Plan's
`Lowering`, so the runtime runs the plan the compiler made (it lowers nothing again), and
the timeout. `shardc compile` writes exactly the text
`compile_model` executes. It lives above the compiler because it needs the runtime.
"""
from __future__ import annotations

import linecache
import time

from torch import nn

from shardc.dsl.errors import ShardcError
from shardc.runtime.compile import split_compiled
from shardc.runtime.groups.unit import holds_sharded
from shardc.handoff import job_plan

__all__ = ["compile_model", "load_emitted", "NO_PROCESS_GROUP", "ALREADY_SHARDED"]

ALREADY_SHARDED = ("shardc.compile was given a module that is already sharded (a ShardedModule, or a module "
                   "inside one, whose parameters shardc has taken): compile the original model once and train "
                   "the ShardedModule it returns")
NO_PROCESS_GROUP = ("shardc.compile returns a distributed module, so it runs in one process per rank: "
                    "launch your script with torchrun (e.g. `torchrun --nproc-per-node 4 train.py`) and call "
                    "torch.distributed.init_process_group() before it; `shardc compile ... -o out.py` "
                    "writes the module without a process group")


def load_emitted(source: str, name: str) -> dict:
    """Execute emitted source as a module namespace (kept in linecache for tracebacks)."""
    filename = f"<shardc-emitted {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": f"shardc_emitted_{name}"}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 — our own generated code
    return namespace


def _is_device_mesh(mesh) -> bool:
    from torch.distributed.device_mesh import DeviceMesh
    return isinstance(mesh, DeviceMesh)


def compile_model(model: nn.Module, strategy, example_inputs=None, capture: str = "auto", mesh=None,
                  timeout: float | None = None, passes=None, backend: str = "eager", init=None, device=None):
    """`shardc.compile`: the same pipeline as `shardc compile`, run in memory. `timeout`
    (seconds) overrides $SHARDC_TIMEOUT for every wait on a peer (runtime/eager/faults.py);
    `passes` names the plan passes to run (None: all, `()`: none); `backend="inductor"` is
    the whole-step compiled mode (docs/compiler.md). A model built on the meta device is
    initialized by `init` from the RNG state as it was when this call began (so
    `torch.manual_seed(s)` right before it gives the values of one process's
    `model.apply(init)`), on `device` (runtime/build.py)."""
    import torch.distributed as dist
    if isinstance(model, nn.Module) and holds_sharded(model):     # runtime/groups/unit.py [Note: sharded modules]
        raise ShardcError(ALREADY_SHARDED)
    if not (dist.is_available() and dist.is_initialized()):
        raise ShardcError(NO_PROCESS_GROUP)
    from shardc.runtime.state.init import rng_state
    rng = rng_state()                     # what a meta model initializes from (compiling draws nothing)
    inner, _ = split_compiled(model)      # the compiler sees the module torch.compile wrapped
    # rank 0 compiles, the others receive its plan (shardc/handoff.py [Note: capture once per job])
    clock = {"capture_s": 0.0, "lowering_s": 0.0}
    t = time.perf_counter()
    source, plan, origin = job_plan(inner, strategy, example_inputs, capture, mesh, passes, backend, clock)
    clock["plan_s"] = time.perf_counter() - t           # compiled, received or read: this rank's wait for it
    t = time.perf_counter()
    namespace = load_emitted(source, plan.strategy.name)
    # the plan the compiler made, not lowered again
    sm = namespace["shard_model"](model, lowering=plan.lowering, timeout=timeout,
                                  mesh=mesh if _is_device_mesh(mesh) else None, init=init, device=device,
                                  rng=rng)
    sm.plan = plan
    sm.source = source
    sm.plan_origin = origin               # "compiled", "received" (from rank 0) or "cache"
    clock["construct_s"] = time.perf_counter() - t      # groups, allocation, values (runtime/build.py)
    clock.update(sm.build_seconds)        # construct_s's parts: groups_s, allocation_s, values_s
    sm.startup_seconds = clock            # wall seconds per phase of this call (bench/bigmodel.py)
    return sm
