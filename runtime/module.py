"""ShardedModule and shard_module — stage: runtime (entry point of emitted code).

Input: an nn.Module, a resolved `Strategy`, the compiler's `UnitSpec` list (root first,
then forward order), optionally a `ShardMesh`, and the plan of those units (the
compiler's `Lowering`; without one it is lowered here, once, with the named plan passes).
Output: a `ShardedModule` whose parameters live in per-unit flat shards, with the
optimizer, clipping, ledger, memory report and state-dict methods of docs/internals.md.

[Note: parameters become views]
Every parameter is removed from its module's `_parameters` and replaced by a plain
attribute holding a view of its unit's full buffer (re-set on every forward gather;
tied aliases get the same view). The persistent storage is the shard; `.module` has no
registered parameters left, so `full_state_dict()` is the way to read values back.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Strategy
from shardc.lowering import Lowering, RankPlan, Schedule, Stage, lower, unit_sizes
from shardc.units import UnitSpec, canonical_names, local_params, unit_members

from . import buffers, clip, graph_mode, memory
from .comm import Comm
from .compile import compile_like, eager
from .device import model_device
from .state import checkpoint, full
from .state.dtensor_params import check_root_dims, local_tensor, tp_params
from .state.hooks import AnyKey, KeyModifiers
from .state.params import ParamSet
from .dtypes import torch_dtype
from .engine import Engine
from .errors import RuntimeUsageError
from .faults import Faults
from .flat_group import FlatGroup
from .layout import build_layout
from .ledger import Ledger, LedgerRecord
from .mesh import ShardMesh
from .optimizer import build_optimizer, install
from .storage import FlatStorage
from .unit import UnitState
from .workspace import Workspace


def _broadcast_from_rank0(model: nn.Module, group) -> None:
    """Every rank of the mesh (`group`) starts from the values of its first rank (not recorded
    in the ledger); a tensor-parallel parameter's local shard, never the whole."""
    if group is None:
        return
    with torch.no_grad():
        for t in model.parameters():
            dist.broadcast(local_tensor(t), group=group, group_src=0)
    buffers.broadcast(model, group)


def _shard_mesh(mesh, strategy: Strategy, dev: torch.device) -> ShardMesh:
    """The mesh the units shard over: `mesh` a DeviceMesh (the world's or a sub-mesh, its dims
    the strategy's levels), a ShardMesh, or None (a mesh of the whole world)."""
    if isinstance(mesh, ShardMesh):
        return mesh
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise ShardcError(f"mesh must be a DeviceMesh (or None for the whole world), not {type(mesh).__name__}")
    return ShardMesh(strategy.mesh, dev.type, mesh)


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


def _make_storage(names, local, gplan, plan, is_root) -> FlatStorage:
    """The stored states of the flat group of `names` (`local`: each parameter's data on this
    rank, a DTensor's local shard), with the plan's padded size."""
    layout = build_layout([(n, tuple(local[n].shape)) for n in names], gplan.trainable, gplan.n)
    dtype = torch_dtype(plan.scopes.params.dtype)
    dev = next(iter(local.values())).device
    init = torch.zeros(layout.n, dtype=dtype, device=dev)
    for s in layout.slots:
        init[s.offset:s.offset + s.numel].copy_(local[s.fqn].detach().reshape(-1))
    return FlatStorage(layout, plan, init, is_root)


class ShardedModule(nn.Module):
    def __init__(self, model: nn.Module, strategy: Strategy, units: list[UnitSpec], mesh=None,
                 hooks: bool = True, schedule: Schedule | None = None, timeout: float | None = None,
                 passes=None, lowering: Lowering | None = None, backend: str = "eager"):
        super().__init__()
        graph_mode.check_backend(backend)
        self.backend = backend
        self.faults = Faults(timeout)
        if not dist.is_initialized():
            raise ShardcError("shard_model/shard_module need one process per rank: launch with torchrun "
                              "(e.g. `torchrun --nproc-per-node 4 train.py`) and call "
                              "torch.distributed.init_process_group() first")
        self.module = model
        self.strategy = strategy
        self.unit_specs = list(units)
        self.ledger = Ledger()
        self.device = model_device(model)
        self.comm = Comm(strategy.mesh, strategy.collectives, self.ledger, _shard_mesh(mesh, strategy, self.device))
        self.faults.bind(self.comm.smesh)
        params, self.aliases, targets, self.param_order = _param_maps(model)
        self.param_targets = targets                       # canonical -> [(module, attr)]: state dicts
        self.names_of = {c: [n for n in self.param_order if self.aliases[n] == c] for c in params}
        self.frozen = {n for n, p in params.items() if not p.requires_grad}
        self.tp = tp_params(params, strategy.mesh.names)          # DTensor parameters (TP, SP)
        check_root_dims(self.comm.smesh.device_mesh, self.tp)
        if backend == "inductor":
            graph_mode.refuse(self.tp)
        _broadcast_from_rank0(model, self.comm.smesh.dp_group())
        local = local_params(model)                                  # a DTensor's local shard
        per_unit = unit_members(self.unit_specs, self.aliases)      # [Note: unit membership]
        canonical = [dataclasses.replace(u, params=tuple(n)) for u, n in zip(self.unit_specs, per_unit)]
        lowered = _lowered(lowering, passes, strategy, unit_sizes(local, canonical))
        # the one plan: what each unit does and the schedule the engine follows
        self.lowering = dataclasses.replace(
            lowered, schedule=_checked(schedule, lowered.schedule, len(self.unit_specs),
                                       hooks or backend == "inductor"))
        self._warm_groups()
        self.faults.apply_timeout(self.comm.smesh)
        self.faults.register()
        states, workspace = [], Workspace()        # one reduce workspace for every unit
        for i, (spec, names, uplan) in enumerate(zip(self.unit_specs, per_unit, self.lowering.units)):
            plan = RankPlan(strategy.mesh, spec.scopes, self.comm.rank)
            groups, tg = [], []
            comm = self.faults.guard(self.comm, spec.name)
            for gplan in uplan.groups:
                sel = [n for n in names if (n not in self.frozen) == gplan.trainable]
                st = _make_storage(sel, local, gplan, plan, i == 0)
                groups.append(FlatGroup(st, gplan, comm, workspace, strategy.mesh.world))
                tg.append([targets[s.fqn] for s in st.layout.slots])
            states.append(UnitState(i, spec, groups, tg, self._wrappers(groups)))
        for mod_targets in targets.values():
            for mod, attr in mod_targets:
                del mod._parameters[attr]
        if backend == "inductor":
            self.runtime = graph_mode.GraphRuntime(model, states, strategy, self.lowering.schedule, self.comm.smesh,
                                                   self.names_of, self.ledger, strategy.mesh.world)
            hooks = False
        else:
            self.runtime = Engine(states, strategy.accumulate, self.lowering.schedule, drive_forward=hooks)
        for u in states:
            self._placeholders(u)
            if u.trainable is not None:
                u.trainable.on_grads = lambda grads, i=u.index: self.runtime.unit_grads(i, grads)
        self.hooks = hooks
        if hooks:
            self._install_hooks()
        self.buffer_sync = buffers.Buffers(model, strategy.buffers, self.faults, self.comm.smesh.dp_group())
        self.buffer_sync.install(self)
        # what sm.parameters() yields, from here on (runtime/state/params.py)
        canon = list(dict.fromkeys(self.aliases[n] for n in self.param_order))
        self.params = ParamSet(states, canon, self.tp, self.comm, self.ledger, self.runtime.boundary)
        self.runtime.boundary.backward_listeners.append(self.params.attach_grads)
        self._shardc_keys = AnyKey()           # torch's key check walks here (`_fqn_modifiers`)
        install()

    def _wrappers(self, groups) -> list[list]:
        """Per group, per slot: how a view becomes the module's parameter (a DTensor
        parameter's view is wrapped back into a DTensor; None: the view itself)."""
        return [[self.tp[s.fqn].wrap if s.fqn in self.tp else None for s in g.storage.layout.slots]
                for g in groups]

    def _placeholders(self, u: UnitState) -> None:
        """Meta tensors stand in for parameters whose unit is not gathered (in the whole-step
        mode, for every parameter: its graph swaps the gathered views in while it runs)."""
        if all(g.held for g in u.groups) and self.backend == "eager":
            self.runtime.set_views(u)
            return
        for g, targets in zip(u.groups, u.targets):
            for s, slot_targets in zip(g.storage.layout.slots, targets):
                for mod, attr in slot_targets:
                    setattr(mod, attr, torch.empty(s.shape, dtype=g.storage.pdtype, device="meta"))

    def _warm_groups(self) -> None:
        """Create every process group up front, in the same order on every rank."""
        for spec in self.unit_specs:
            plan = RankPlan(self.strategy.mesh, spec.scopes, self.comm.rank)
            for lv in plan.groups():
                if lv and plan.s(lv) > 1:
                    self.comm.smesh.group(lv)

    def _install_hooks(self) -> None:
        rt = self.runtime
        for u in rt.units[1:]:
            mods = u.spec.modules
            for name in mods:
                m = self.module.get_submodule(name)

                @eager
                def pre(mod, args, u=u):
                    if not u.running:
                        rt.pre_forward(u.index)

                @eager
                def post(mod, args, out, u=u):
                    rt.module_done(u.index, out)

                m.register_forward_pre_hook(pre)
                m.register_forward_hook(post)

    @property
    def schedule(self) -> Schedule:
        """The schedule the engine follows (`self.lowering.schedule`)."""
        return self.lowering.schedule

    def compile(self, *args, **kwargs) -> None:
        """`nn.Module.compile`: compile this module's calls in place with torch.compile's
        arguments (runtime/compile.py, [Note: the root unit on the hooks path])."""
        compile_like(self, lambda fn: torch.compile(fn, *args, **kwargs))

    # -- forward ------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.backend == "inductor":
            return self.runtime.forward(*args, **kwargs)
        self.runtime.begin_forward()
        out = self.module(*args, **kwargs)
        return self.runtime.end_forward(out)

    @property
    def events(self) -> list[tuple[str, int]]:
        return self.runtime.events

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's spelling, after which the loop decides: backwards with it False accumulate
        without the step's gradient sync; each backward with it True ends by issuing it (see
        boundary.py's [Note: accumulation]). `recurse` is accepted for FSDP2 compatibility."""
        self.runtime.boundary.requires_sync = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's spelling: backwards inside do not issue the step's gradient sync."""
        self.runtime.boundary.no_sync_depth += 1
        try:
            yield
        finally:
            self.runtime.boundary.no_sync_depth -= 1

    # -- optimizer and gradients ----------------------------------------------------
    def optimizer(self, cls, param_groups=None, **kw) -> torch.optim.Optimizer:
        """`cls` over this module's trainable parameters (`param_groups` name them); the same
        as `cls(sm.parameters(), ...)` (runtime/optimizer.py [Note: adoption ...])."""
        return build_optimizer(self.params, self._trainable_aliases(), self.frozen, cls, param_groups, **kw)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every live optimizer over this module's parameters, in the order they were adopted."""
        return self.params.live_optimizers()

    def _trainable_aliases(self) -> dict[str, str]:
        return {a: c for a, c in self.aliases.items() if c not in self.frozen}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.runtime.boundary.zero_grad()
        if set_to_none:
            self.params.clear_grads()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if norm_type != 2.0:
            raise RuntimeUsageError("clip_grad_norm_ supports only the 2-norm")
        boundary = self.runtime.boundary
        boundary.wait_sync("clip_grad_norm_()")
        self.params.drop_frozen_grads()
        self.params.grads_changed()
        return clip.clip_grad_norm_(boundary.trainable_groups(), self.lowering.clip_rows,
                                    self.faults.guard(self.comm, "<all units>"), self.tp, max_norm, self.device)

    def set_timeout(self, seconds: float) -> None:
        """Change the shardc timeout (every wait on a peer, and the process groups')."""
        self.faults.set_timeout(seconds, self.comm.smesh)

    # -- ledger, memory, state dicts --------------------------------------------------
    def comm_ledger(self) -> list[LedgerRecord]:
        return self.ledger.records()

    def reset_comm_ledger(self) -> None:
        self.ledger.reset()

    def memory_report(self) -> dict[str, int]:
        return memory.memory_report(self.runtime, self.optimizers)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The original model's `state_dict()` keys as full tensors: every parameter (original
        names and shapes, tied aliases included) and persistent buffer.

        Collective: every rank must call it (a lone caller gets an error naming it after
        the shardc timeout). With `rank0_only`, ranks other than 0 return {}."""
        self.runtime.boundary.complete_updates()          # deferred update all-gathers (plan pass)
        return full.full_state_dict(self, rank0_only)

    def full_optim_state_dict(self, optimizer, rank0_only: bool = False) -> dict:
        """`optimizer`'s state as torch's layout keyed by parameter names, each state tensor
        of its parameter's full shape (what a single-process run's optimizer would hold).

        Collective, like `full_state_dict`."""
        self.runtime.boundary.complete_updates()
        return full.full_optim_state_dict(self, optimizer, rank0_only)

    def load_full_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) tensors, e.g. from `full_state_dict()`: `load_state_dict`
        takes them as they are (every name and shape checked first). Collective."""
        self.load_state_dict(sd)

    def state_dict(self, *args, **kwargs) -> dict:
        """The original model's `state_dict()` keys: each parameter (global, unpadded
        shape; this rank's piece of it, see runtime/state/checkpoint.py) and persistent buffer:
        what `dcp.save` writes and `get_state_dict(sm, opt)` returns. Local, except under `buffers broadcast` after a
        training forward: then a collective (rank 0's buffers are broadcast first), so call
        it on every rank."""
        self.runtime.boundary.complete_updates()
        return checkpoint.model_state_dict(self)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load `state_dict()`-shaped (or full-tensor) entries; checks every name and shape
        before changing anything. Collective (re-gathers the params shards)."""
        self.runtime.boundary.complete_updates()
        self.faults.enter("load_state_dict()")
        return checkpoint.load_model_state_dict(self, state_dict, strict)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Every parameter of the model under its original name, from construction on: this
        rank's piece with the whole tensor's shape and numel, as FSDP2's DTensors
        (runtime/state/params.py). Tied parameters once, or under every name with
        `remove_duplicate=False`; frozen ones with requires_grad=False."""
        for name in self.param_order:
            canon = self.aliases[name]
            if remove_duplicate and name != canon:
                continue
            yield prefix + name, self.params.params[canon]

    def __deepcopy__(self, memo):
        raise RuntimeUsageError("a ShardedModule cannot be deep-copied (its parameters are this rank's pieces, "
                                "as FSDP's are): for an EMA or averaged copy keep tensors of "
                                "sm.full_state_dict(), or torch.optim.swa_utils with a model loaded from it")

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint.state_dict: keys resolve through `.module`, hook-made
        ones included (runtime/state/hooks.py `KeyModifiers`)."""
        return KeyModifiers()


def _lowered(lowering: Lowering | None, passes, strategy: Strategy, sizes) -> Lowering:
    """The plan of these units: `lowering` as given (the compiler's; it must plan exactly
    these units: names, scopes, element counts), else lowered here with `passes`."""
    if lowering is None:
        return lower(strategy.mesh, sizes, strategy.prefetch, passes)
    want = [(s.name, s.scopes, tuple((t, phi) for phi, t in ((s.trainable, True), (s.frozen, False)) if phi))
            for s in sizes]
    got = [(u.name, u.scopes, tuple((g.trainable, g.phi) for g in u.groups)) for u in lowering.units]
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


def shard_module(model: nn.Module, strategy: Strategy, units: list[UnitSpec], mesh=None,
                 hooks: bool = True, schedule: Schedule | None = None,
                 timeout: float | None = None, passes=None, lowering: Lowering | None = None,
                 backend: str = "eager") -> ShardedModule:
    """Shard `model` per `strategy` over its `units` (root first); see docs/internals.md.

    `lowering`: the plan of these units (the compiler's `Lowering`, which `shardc.compile`
    hands over); without one it is lowered here, once, with the plan passes named in
    `passes` (None: all). `schedule` (default: the lowering's) says which gathers are issued
    before each unit runs, forward and backward; it replaces the lowering's, so
    `sm.lowering.schedule` is what the engine follows (`sm.schedule`). With `hooks=False`
    the caller's forward issues the forward gathers itself (emitted code), so the schedule
    must have no forward stages (the engine follows only the backward stages). `timeout`
    (seconds; default $SHARDC_TIMEOUT or 600) bounds every wait on a peer. `backend="inductor"`
    is the whole-step compiled mode (runtime/graph_mode.py): each micro-batch one compiled
    graph, forward and backward joined, and the step boundary one more."""
    return ShardedModule(model, strategy, units, mesh=mesh, hooks=hooks, schedule=schedule,
                         timeout=timeout, passes=passes, lowering=lowering, backend=backend)
