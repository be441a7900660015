"""Plan hand-off — stage: public API (one rank's compile -> every rank's emitted module and Plan).

Input: what `shardc.compile` compiles (model, strategy, example inputs, capture mode,
mesh, plan passes, backend). Output: `job_plan` gives the emitted module's text, its
`Plan` and where they came from (`"compiled"`, `"received"` or `"cache"`).

[Note: capture once per job]
The Plan is data (frozen dataclasses, the emitted text a string), and every rank of a
job compiles the same model under the same strategy, so one rank's compile serves all:
rank 0 captures and lowers, and `torch.distributed.broadcast_object_list` hands the text
and the Plan to the others, which capture nothing. With `$SHARDC_PLAN_CACHE` naming a
directory, the compiling rank first looks there for the plan of this key and writes it
after compiling, so a restarted job compiles nothing. The key (`plan_key`) is a hash of
everything the plan depends on: the model's structure (its class, every module's class,
every parameter's and buffer's name, shape, dtype and requires_grad), the strategy text,
the mesh, the example inputs' shapes and dtypes, the capture mode, the plan passes, the
backend, the world size and torch's and shardc's versions. Each receiving rank checks the
key it computes for itself against the one sent: a rank whose model or strategy differs
is one sentence on every rank (one `all_gather_object` of a flag), never a wrong plan. A failed compile on rank 0 is the same sentence on
every rank (the others would otherwise wait for a plan that never comes).

A rank alone compiles for itself: a world of one, and a simulated rank of `shardc
simulate` (torch's `fake` process group moves nothing, docs/simulate.md). So does every
rank of a model with DTensor parameters (tensor or expert parallelism): tracing it runs
DTensor's collectives over its tp or ep group, which needs every peer of that group in the
trace too — rank 0 tracing alone while its peers wait for the plan would deadlock (found
by the suite's DP x TP benchmark test).
The cache is a pickle of the Plan: point `$SHARDC_PLAN_CACHE` only at a directory the
job's own user writes.
"""
from __future__ import annotations

import hashlib
import os
import pickle

import torch
import torch.distributed as dist
from torch import nn

import shardc
from shardc.compiler.api import compile_source
from shardc.dsl.errors import ShardcError
from shardc.dsl.unparse import unparse

__all__ = ["job_plan", "plan_key", "CACHE_ENV"]

CACHE_ENV = "SHARDC_PLAN_CACHE"


def _strategy_text(strategy) -> str:
    if isinstance(strategy, (str, os.PathLike)) and os.path.isfile(strategy):
        with open(strategy, encoding="utf-8") as f:
            return f.read()
    if isinstance(strategy, (str, os.PathLike)):
        return os.fspath(strategy)
    try:
        return unparse(strategy)
    except Exception:  # noqa: BLE001 — a bad strategy is the compile's sentence, not the key's
        return repr(strategy)


def _mesh_text(mesh) -> str:
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(mesh, DeviceMesh):
        return repr((mesh.mesh_dim_names, tuple(mesh.mesh.shape)))
    return repr(mesh)


def _inputs_text(example_inputs) -> str:
    leaves = torch.utils._pytree.tree_leaves(example_inputs)
    return repr([(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (type(x).__name__, x)
                 for x in leaves])


def plan_key(model: nn.Module, strategy, example_inputs, capture, mesh, passes, backend, world: int) -> str:
    """The hash every input of the plan goes into (see the module note)."""
    h = hashlib.sha256()
    for part in (type(model).__module__ + "." + type(model).__qualname__,
                 repr([(n, type(m).__qualname__) for n, m in model.named_modules()]),
                 repr([(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()]),
                 repr([(n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()]),
                 _strategy_text(strategy), _mesh_text(mesh), _inputs_text(example_inputs), repr(capture),
                 repr(None if passes is None else tuple(passes)), repr(backend), repr(world),
                 torch.__version__, shardc.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _cached(key: str):
    where = os.environ.get(CACHE_ENV)
    path = os.path.join(where, f"plan-{key}.pkl") if where else None
    if path and os.path.isfile(path):
        with open(path, "rb") as f:
            return pickle.load(f), path   # noqa: S301 — the job's own cache (module note)
    return None, path


def _compile_or_cache(key: str, compile_args, clock=None):
    found, path = _cached(key)
    if found is not None:
        return (*found, "cache")
    source, plan = compile_source(*compile_args, clock=clock)
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump((source, plan), f)
        os.replace(tmp, path)              # atomic: a reader sees a whole plan or none
    return source, plan, "compiled"


def _alone(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor
    return dist.get_world_size() == 1 or dist.get_backend() == "fake" or \
        any(isinstance(p, DTensor) for p in model.parameters())


def job_plan(model: nn.Module, strategy, example_inputs=None, capture: str = "auto", mesh=None, passes=None,
             backend: str = "eager", clock: dict | None = None):
    """(emitted text, Plan, origin): compiled here, received from rank 0, or read from the cache;
    `clock` gets compile_source's phases where this rank compiled."""
    world = dist.get_world_size()
    key = plan_key(model, strategy, example_inputs, capture, mesh, passes, backend, world)
    args = (model, strategy, example_inputs, capture, mesh, None, passes, backend)
    if _alone(model):
        return _compile_or_cache(key, args, clock)
    origin = None
    rank = dist.get_rank()
    box = [None]
    if rank == 0:
        try:
            source, plan, origin = _compile_or_cache(key, args, clock)
            box = [(key, source, plan, None)]
        except Exception as e:  # noqa: BLE001 — every rank learns it; rank 0 raises it as it is
            box = [(key, None, None, str(e) if isinstance(e, ShardcError) else f"{type(e).__name__}: {e}")]
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    sent, source, plan, error = box[0]
    if error is not None:
        raise ShardcError(f"rank 0 could not compile the model, so no rank has a plan: {error}")
    agree = [None] * dist.get_world_size()
    dist.all_gather_object(agree, sent == key)       # every rank stops, not only the one that differs
    if not all(agree):
        odd = ", ".join(str(r) for r, ok in enumerate(agree) if not ok)
        raise ShardcError(f"rank {odd}'s model, strategy, mesh or example inputs differ from rank 0's (the plan's "
                          f"key is not rank 0's {sent[:12]}): every rank must compile the same model under the "
                          f"same strategy")
    return source, plan, origin if rank == 0 else "received"
