"""Construction — stage: runtime. A model, its strategy and its units -> the sharded units
with their values, the engine and the parameters, ready for `ShardedModule` (the API).

Input: what `shard_module` takes: the model (with values, or built on the meta device), the
resolved `Strategy`, the compiler's `UnitSpec`s, the mesh, the plan (`Lowering`) or the
passes to lower with, the backend, `init` and `device`. Output: `Built`.

[Note: allocate -> values -> keep the shard -> free]
Every rank allocates only its shards (FlatStorage: zero), then gives them values from one
of three sources, decided by every rank together (`_source`):
  * SCATTER — the mesh's first rank has values (every rank may, or only the first, the
    others on meta): it lays out one unit at a time and each rank receives only its
    chunks (runtime/state/scatter.py), so every rank starts from the first rank's values
    (DDP's rule) without anyone receiving the whole model;
  * INIT — every rank built the model on the meta device: `init` runs per module, in
    `nn.Module.apply`'s order, and each rank keeps its parts (runtime/state/init.py), so
    the values are a function of the seed and the model only;
  * NONE — meta, and `init=False`: the parameters wait for a load (DCP, safetensors,
    `load_state_dict`); until then a forward, a step or a whole-tensor read is refused.
After that the module's parameters are removed (parameters become views: module.py) and
no rank holds a whole unit outside a gather.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Strategy
from shardc.lowering import Lowering, Over, RankPlan, Schedule, Stage, kinds_of, lower, over_of, unit_sizes
from shardc.lowering.owned import owned_plan
from shardc.units import UnitSpec, canonical_names, local_params, unit_members

from . import buffers, simulation
from .graph import mode as graph_mode
from .step import owned
from .casts import install_casts
from .eager.comm import Comm
from .transport.device import model_device
from .eager.engine import Engine
from .eager.faults import Faults
from .groups.flat_group import FlatGroup
from .groups.layout import build_layout
from .ledger import Ledger
from .transport.mesh import ShardMesh
from .state import init as state_init
from .state.dtensor_params import check_root_dims, tp_params
from .state.params import ParamSet
from .state.init import materialize_buffers, unset_buffers
from .state.init_first import initialize_first
from .state.scatter import scatter_values
from .groups.storage import FlatStorage
from .groups.unit import UnitState
from .groups.workspace import Workspace
from .groups import placed

NEED_DIST = ("shard_model/shard_module need one process per rank: launch with torchrun "
             "(e.g. `torchrun --nproc-per-node 4 train.py`) and call "
             "torch.distributed.init_process_group() first")


class Source(enum.Enum):
    SCATTER = "scatter"
    INIT = "init"
    NONE = "none"


class Built(NamedTuple):
    """What a ShardedModule holds (see the module docstring)."""
    module: nn.Module
    strategy: Strategy
    unit_specs: list
    backend: str
    faults: Faults
    ledger: Ledger
    device: torch.device
    comm: Comm
    aliases: dict
    param_order: list
    param_targets: dict
    names_of: dict
    frozen: set
    tp: dict
    lowering: Lowering
    runtime: object
    hooks: bool
    params: ParamSet
    dtensors: dict                     # every DTensor parameter: `tp`'s and the experts'
    build_seconds: dict                # wall seconds: groups, allocation (the shards), values


def build(model: nn.Module, strategy: Strategy, units: list[UnitSpec], mesh=None, hooks: bool = True,
          schedule: Schedule | None = None, timeout: float | None = None, passes=None,
          lowering: Lowering | None = None, backend: str = "eager", init=None, device=None,
          rng=None) -> Built:
    graph_mode.check_backend(backend)
    kinds = kinds_of(strategy)                           # placements besides the units' own
    placed.refuse_graph(kinds, strategy, backend)
    faults = Faults(timeout)
    if not dist.is_initialized():
        raise ShardcError(NEED_DIST)
    meta = _on_meta(model)
    dev = _device(model, mesh, device, meta)
    ledger = Ledger()
    comm = Comm(strategy.mesh, strategy.collectives, ledger, _shard_mesh(mesh, strategy, dev))
    faults.bind(comm.smesh)
    params, aliases, targets, order = _param_maps(model)
    names_of = {c: [] for c in params}                   # one pass (was |params| x |order|)
    for n in order:
        names_of[aliases[n]].append(n)
    frozen = {n for n, p in params.items() if not p.requires_grad}
    where = placed.placed(kinds, comm, strategy, params)   # each placement's Comm; the experts' DTensors
    tp = tp_params(params, strategy.mesh.names, where.params)   # DTensor parameters (TP, SP)
    check_root_dims(comm.smesh.device_mesh, tp)
    dtensors = tp | where.params                        # views wrapped, pieces at their global offsets
    comms = where.comms
    if backend == "inductor":
        graph_mode.refuse(tp)
    source = Source.NONE if simulation.active() else _source(meta, init, comm.smesh, dev)
    local = local_params(model)                          # shapes; a DTensor's local shard
    specs = list(units)
    per_unit = unit_members(specs, aliases)              # [Note: unit membership]
    canonical = [dataclasses.replace(u, params=tuple(n)) for u, n in zip(specs, per_unit)]
    oplan = owned_plan(strategy.mesh, canonical, {n: t.shape for n, t in params.items()},
                       {n: n not in frozen for n in params})   # lowering/owned.py
    owned.refuse(oplan, strategy, backend, tp)
    lowered = _lowered(lowering, passes, strategy, unit_sizes(local, canonical, kinds))
    # the one plan: what each unit does and the schedule the engine follows
    lowering = dataclasses.replace(lowered, schedule=_checked(schedule, lowered.schedule, len(specs),
                                                              hooks or backend == "inductor"), owned=oplan)
    t = time.perf_counter()
    placed.warm_groups(comms, kinds, strategy.mesh, specs)
    for c in {id(c): c for c in comms.values()}.values():
        faults.apply_timeout(c.smesh)
    faults.register()
    seconds = {"groups_s": time.perf_counter() - t}
    t = time.perf_counter()
    states = _units(specs, per_unit, lowering, frozen, local, targets, dtensors, strategy, kinds, comms,
                    faults, dev)
    seconds["allocation_s"], t = time.perf_counter() - t, time.perf_counter()
    unset = _values(source, model, states, params, targets, init, dev, {o: c.smesh for o, c in comms.items()},
                    where.no_init, rng, bool(dtensors))
    seconds["values_s"] = time.perf_counter() - t
    for places in targets.values():
        for mod, attr in places:
            del mod._parameters[attr]
    if backend == "inductor":
        runtime = graph_mode.GraphRuntime(model, states, strategy, lowering.schedule, comm.smesh,
                                          names_of, ledger, strategy.mesh.world)
        hooks = False
    else:
        runtime = Engine(states, strategy.accumulate, lowering.schedule, drive_forward=hooks)
    for u in states:
        _placeholders(u, runtime, backend)
        for g in u.trainables:
            g.route_grads(lambda grads, i=u.index, g=g: runtime.unit_grads(i, grads, g))
    if hooks:
        _install_hooks(model, runtime)
    install_casts(model, specs)                          # units/casts.py [Note: casts at unit boundaries]
    canon = list(dict.fromkeys(aliases[n] for n in order))
    pset = ParamSet(states, canon, dtensors, comm, ledger, runtime.boundary, comms, lowering.owned,
                    lowering.clip_rows, tp)
    if not simulation.active():                          # a simulated rank needs no values
        pset.expect_values(unset, unset_buffers(model))
    return Built(model, strategy, specs, backend, faults, ledger, dev, comm, aliases, order, targets,
                 names_of, frozen, tp, lowering, runtime, hooks, pset, dtensors, seconds)


# -- where the values come from -------------------------------------------------------------
def _on_meta(model: nn.Module) -> bool:
    """Whether the parameters are on the meta device (all of them; some is refused)."""
    flags = {bool(p.is_meta) for p in model.parameters()}
    if flags == {True, False}:
        where = next(n for n, p in model.named_parameters() if p.is_meta)
        raise ShardcError(f"parameter {where!r} is on the meta device but others have values: build the "
                          f"whole model on the meta device (shardc initializes or loads it) or the whole "
                          f"model with values")
    return flags == {True}


def _device(model: nn.Module, mesh, device, meta: bool) -> torch.device:
    """Where the shards live: `device` when named, else the model's, else (on meta) the
    mesh's device type (an NCCL group: this rank's current CUDA device; gloo: the CPU);
    meta on a simulated rank (runtime/simulation.py)."""
    if simulation.active():
        if not meta:
            raise ShardcError("a simulated rank shards a model built on the meta device (with torch.device"
                              "('meta'): model = ...), not one with values")
        return torch.device("meta")
    if device is not None:
        return _indexed(torch.device(device))
    if not meta:
        return model_device(model)
    if isinstance(mesh, DeviceMesh):
        return _indexed(torch.device(mesh.device_type))
    return _indexed(torch.device("cuda" if dist.get_backend() == "nccl" else "cpu"))


def _indexed(dev: torch.device) -> torch.device:
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _source(meta: bool, init, smesh: ShardMesh, dev: torch.device) -> Source:
    """Decided by every rank together: the first rank's values (scatter) when it has them,
    else init (every rank on meta), else a refusal naming what is mixed."""
    if init is not None and init is not False and not callable(init):
        raise ShardcError(f"init must be a function called per module, False (no values: load them) or "
                          f"None (each module's reset_parameters()), not {type(init).__name__}")
    group = smesh.dp_group()
    first_meta, metas = meta, int(meta)
    if group is not None:
        t = torch.tensor([int(meta) if smesh.rank == 0 else 0, int(meta)], device=dev)
        dist.all_reduce(t, group=group)
        first_meta, metas = bool(t[0]), int(t[1])
    if first_meta and metas != smesh.mesh.world:
        raise ShardcError("the mesh's first rank built the model on the meta device but another rank built it "
                          "with values: build it on meta everywhere (shardc initializes it) or with values on "
                          "the first rank (shardc scatters them)")
    if not first_meta:
        if init is not None and init is not False:
            raise ShardcError("init= initializes a model built on the meta device, but this one has values "
                              "(on the mesh's first rank); drop init= or build the model on the meta device")
        return Source.SCATTER
    return Source.NONE if init is False else Source.INIT


def _values(source: Source, model, states, params, targets, init, dev, smeshes, no_init, rng,
            dtensors: bool) -> set[str]:
    """Every storage's values from `source`; returns the parameters left without one. A
    placement's values come from the first rank of its own mesh (`smeshes`: the ShardMesh of
    each placement's mesh; the experts': it holds this rank's experts); `no_init`: why an
    init cannot give them (runtime/groups/placed.py), or None. An init is run by the first
    rank alone and sent (runtime/state/init_first.py) where the data-parallel group is
    the whole world and no parameter is a DTensor (`dtensors`); else by every rank."""
    storages = [g.storage for u in states for g in u.groups]
    smesh = smeshes[Over.DENSE]
    if source is Source.SCATTER:
        for over, mesh in smeshes.items():
            mine = [g.storage for u in states for g in u.groups if g.gplan.placement.over == over]
            scatter_values(mine, params if mesh.rank == 0 else None, mesh)
        materialize_buffers(model, dev)
        buffers.broadcast(model, smesh.dp_group())
        return set()
    if source is Source.NONE:
        materialize_buffers(model, dev)
        return set(params)
    if no_init is not None:
        raise ShardcError(no_init)
    fn = init or state_init.reset_parameters
    if not isinstance(fn, state_init.BuffersOnly) and not dtensors and smesh.dp_group() is not None \
            and smesh.mesh.world == dist.get_world_size():
        return initialize_first(model, fn, storages, params, dev, smesh, rng)
    where = {}
    for st in storages:
        for s in st.layout.slots:
            where[s.fqn] = (st, s)
    places = {id(p): [lambda v, w=where[n]: w[0].write_param(w[1], v)] for n, p in params.items()}
    names = {id(p): n for n, p in params.items()}
    return state_init.initialize(model, fn, places, names, dev, rng)


# -- units ------------------------------------------------------------------------------------
def _units(specs, per_unit, lowering, frozen, local, targets, tp, strategy, kinds, comms, faults, dev) -> list:
    """The sharded units; a group's rows run on the Comm of its placement's mesh (`comms`,
    keyed by `Over`), divided by the whole data-parallel world like every group's
    (runtime/transport/experts.py, [Note: expert gradients are averaged over the whole data-parallel degree])."""
    states, workspace = [], Workspace()        # one reduce workspace for every unit
    for i, (spec, names, uplan) in enumerate(zip(specs, per_unit, lowering.units)):
        groups, tg = [], []
        guarded = {o: faults.guard(c, spec.name) for o, c in comms.items()}
        for gplan in uplan.groups:
            pl = gplan.placement
            sel = [n for n in names if (n not in frozen) == gplan.trainable and over_of(kinds, n, local[n]) == pl.over]
            layout = build_layout([(n, tuple(local[n].shape)) for n in sel], gplan.trainable, gplan.n)
            st = FlatStorage(layout, RankPlan(pl.mesh, pl.scopes, comms[pl.over].rank), dev, i == 0, pl.over)
            groups.append(FlatGroup(st, gplan, guarded[pl.over], workspace, strategy.mesh.world))
            tg.append([targets[s.fqn] for s in st.layout.slots])
        wrappers = [[tp[s.fqn].wrap if s.fqn in tp else None for s in g.storage.layout.slots] for g in groups]
        states.append(UnitState(i, spec, groups, tg, wrappers))
    return states


def _placeholders(u: UnitState, runtime, backend: str) -> None:
    """Meta tensors stand in for parameters whose unit is not gathered (in the whole-step
    mode, for every parameter: its graph swaps the gathered views in while it runs)."""
    if all(g.held for g in u.groups) and backend == "eager":
        runtime.set_views(u)
        return
    for g, targets in zip(u.groups, u.targets):
        for s, slot_targets in zip(g.storage.layout.slots, targets):
            for mod, attr in slot_targets:
                setattr(mod, attr, torch.empty(s.shape, dtype=g.storage.pdtype, device="meta"))


def _install_hooks(model: nn.Module, rt) -> None:
    from .compile import eager
    for u in rt.units[1:]:
        for name in u.spec.modules:
            m = model.get_submodule(name)

            @eager
            def pre(mod, args, u=u):
                if not u.running:
                    rt.pre_forward(u.index)

            @eager
            def post(mod, args, out, u=u):
                rt.module_done(u.index, out)

            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)


# -- inputs ----------------------------------------------------------------------------------
def _shard_mesh(mesh, strategy: Strategy, dev: torch.device) -> ShardMesh:
    """The mesh the units shard over: `mesh` a DeviceMesh (the world's or a sub-mesh, its dims
    the strategy's levels), a ShardMesh, or None (a mesh of the whole world)."""
    if isinstance(mesh, ShardMesh):
        return mesh
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise ShardcError(f"mesh must be a DeviceMesh (or None for the whole world), not {type(mesh).__name__}")
    # a simulated rank's meta shards use the groups of the process group's CPU backend
    return ShardMesh(strategy.mesh, "cpu" if dev.type == "meta" else dev.type, mesh)


def _param_maps(model: nn.Module):
    """canonical FQN -> parameter, alias FQN -> canonical (`canonical_names`), canonical ->
    [(module, attr)], and every FQN in registration order."""
    aliases = canonical_names(model)
    targets, order = {}, []
    for mname, mod in model.named_modules(remove_duplicate=False):
        for attr, p in list(mod._parameters.items()):
            if p is None:
                continue
            fqn = f"{mname}.{attr}" if mname else attr
            order.append(fqn)
            lst = targets.setdefault(aliases[fqn], [])
            if not any(m is mod and a == attr for m, a in lst):
                lst.append((mod, attr))
    params = {aliases[f]: p for f, p in model.named_parameters(remove_duplicate=False)}
    return params, aliases, targets, order


def _lowered(lowering: Lowering | None, passes, strategy: Strategy, sizes) -> Lowering:
    """The plan of these units: `lowering` as given (the compiler's; it must plan exactly
    these units: names, scopes, element counts), else lowered here with `passes`."""
    if lowering is None:
        return lower(strategy.mesh, sizes, strategy.prefetch, passes)
    want = [(s.name, s.scopes, tuple((t, o, phi) for o in (Over.DENSE, *(k.over for k, _, _ in s.placed))
                                     for phi, t in zip(s.counts(o), (True, False)) if phi))
            for s in sizes]
    got = [(u.name, u.scopes, tuple((g.trainable, g.placement.over, g.phi) for g in u.groups)) for u in lowering.units]
    if len(got) != len(want):
        raise ShardcError(f"the lowering given to shard_module plans {len(got)} units, the unit list has {len(want)}")
    bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    if bad is not None:
        raise ShardcError(f"the lowering given to shard_module does not plan unit {bad} ({want[bad][0]!r}) "
                          f"of these units: its name, scopes or element counts differ")
    return lowering


def _checked(schedule: Schedule | None, lowered: Schedule, n: int, hooks: bool) -> Schedule:
    """The schedule the engine reads (default: the lowering's): it names existing units;
    without hooks the caller's forward issues the forward gathers, so the engine keeps only
    the backward stages (a given one with forward stages is an error: they would not run)."""
    if schedule is None:
        schedule = lowered if hooks else dataclasses.replace(lowered, forward=())
    elif not hooks and schedule.forward:
        raise ShardcError("shard_module(hooks=False) runs the caller's forward, which issues the forward "
                          "gathers itself: pass a schedule without forward stages")
    for st in schedule.forward + schedule.backward + (Stage(0, schedule.sync_early + schedule.update_deferred),):
        bad = [j for j in (st.unit, *st.issue) if not 0 <= j < n]
        if bad:
            raise ShardcError(f"the schedule names unit {bad[0]}, but the model has units 0..{n - 1}")
    return schedule
