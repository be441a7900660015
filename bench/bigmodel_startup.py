"""The start-up paths of bench/bigmodel.py (bench stage: a system's name -> one rank's
model with its values, and the wall seconds of each phase).

Input: how the values come (`init`, `dcp`, `safetensors`), the depth, the work directory,
the phases dict to fill. Output: `start_shardc` (meta build, `shardc.compile` with an
exact init or a buffers-only one, then a load; phases from `sm.startup_seconds`) and
`start_fsdp2` (meta build, the mesh, `fully_shard`, `to_empty`, FSDP2's own init or
torch's DCP recipe), each the module it started.
"""
from __future__ import annotations

import os
import time

import torch

from bigmodel import MESH, SEED, STRATEGY, WORLD, llama, trace


def rotary_only(init):
    """`init` applied to the rotary embeddings only (their non-persistent cache: FSDP2's
    `to_empty` leaves it garbage and no checkpoint holds it)."""
    def fn(m):
        if "RotaryEmbedding" in type(m).__name__:
            init(m)
    return fn


class Timed:
    """`fn` per module, with the wall and CPU seconds spent inside it summed (the init's own
    cost: the random draws and fills, not the copies into shards around it)."""

    def __init__(self, fn):
        self.fn, self.wall, self.cpu = fn, 0.0, 0.0

    def __call__(self, module):
        w, c = time.perf_counter(), time.thread_time()
        self.fn(module)
        self.wall += time.perf_counter() - w
        self.cpu += time.thread_time() - c


def strategy(path: str, algo: str | None) -> str:
    """The strategy file's path, or its text with `collectives ALGO` (bench/peers/systems.py's `@ALGO`)."""
    if algo is None:
        return path
    with open(path) as f:
        return f.read() + f"\ncollectives {algo}\n"


def start_shardc(how: str, layers: int, workdir: str, x: torch.Tensor, phases: dict, algo: str | None = None,
                 path: str = STRATEGY):
    import shardc
    t = time.perf_counter()
    with torch.device("meta"):
        model = llama(layers)
    phases["build_s"] = time.perf_counter() - t
    init = Timed(model._init_weights)
    torch.manual_seed(SEED)
    t = time.perf_counter()
    sm = shardc.compile(model, strategy(path, algo), example_inputs=(x,), mesh=MESH,
                        init=init if how == "init" else shardc.buffers_only(init))
    phases["compile_s"] = time.perf_counter() - t       # with the init (in shardc:init)
    # the breakdown: capture and lowering (0 on a rank that received rank 0's plan), the wait
    # for the plan, construction (groups, allocation, the init's values); shardc/api.py
    phases.update({k: v for k, v in sm.startup_seconds.items()})
    phases["init_wall_s"], phases["init_cpu_s"] = init.wall, init.cpu
    trace("compiled")
    t = time.perf_counter()
    if how == "dcp":
        load_dcp(sm, os.path.join(workdir, "dcp"))
    elif how == "safetensors":
        shardc.load_safetensors(sm, os.path.join(workdir, "hf"))
    phases["load_s"] = time.perf_counter() - t
    return sm


def start_fsdp2(how: str, layers: int, workdir: str, phases: dict, wrap: str = "layers"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    t = time.perf_counter()
    with torch.device("meta"):
        model = llama(layers)
    phases["build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))
    phases["groups_s"] = time.perf_counter() - t
    mods = list(model.model.layers)
    if wrap == "units":                    # bench/llama_zero3_units.shard's units
        mods = [model.model.embed_tokens] + mods + [model.lm_head]
    for mod in mods:
        fully_shard(mod, mesh=mesh)
    fully_shard(model, mesh=mesh)
    t1 = time.perf_counter()
    model.to_empty(device="cpu")
    phases["shard_s"] = time.perf_counter() - t
    phases["allocation_s"] = time.perf_counter() - t1
    trace("to_empty")
    init = Timed(model._init_weights)
    torch.manual_seed(SEED)
    t = time.perf_counter()
    if how == "init":
        model.apply(init)
    else:
        model.apply(rotary_only(init))
        load_dcp(model, os.path.join(workdir, "dcp"))
    phases["load_s" if how == "dcp" else "init_s"] = time.perf_counter() - t
    phases["init_wall_s"], phases["init_cpu_s"] = init.wall, init.cpu
    return model


def load_dcp(model, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=path)
    set_model_state_dict(model, msd)
