"""ShardedModule and shard_module — stage: runtime (entry point of emitted code).

Input: an nn.Module (with values, or built on the meta device), a resolved `Strategy`, the
compiler's `UnitSpec` list (root first, then forward order), optionally a mesh, and the plan
of those units (the compiler's `Lowering`; without one it is lowered, once, with the named
plan passes); `init` and `device` for a model on the meta device. Construction is
runtime/build.py's. Output: a `ShardedModule` whose parameters live in per-unit flat
shards, with the optimizer, clipping, ledger, memory report and state-dict methods of
docs/internals.md.

[Note: parameters become views]
Every parameter is removed from its module's `_parameters` and replaced by a plain
attribute holding a view of its unit's full buffer (re-set on every forward gather;
tied aliases get the same view). The persistent storage is the shard; `.module` has no
registered parameters left, so `full_state_dict()` is the way to read values back.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from shardc.dsl.ir import Strategy
from shardc.lowering import Lowering, Schedule
from shardc.units import UnitSpec

from . import buffers, memory
from .step import clip
from .build import Built, build
from .compile import compile_like
from .errors import RuntimeUsageError
from .ledger import LedgerRecord
from .step.optimizer import build_optimizer, install
from .state import StateView, checkpoint, full
from .state.hooks import AnyKey, KeyModifiers


class ShardedModule(nn.Module):
    """The API of a sharded model; construction is runtime/build.py's (`shard_module`)."""

    def __init__(self, built: Built):
        super().__init__()
        for field, value in built._asdict().items():
            setattr(self, field, value)
        self.buffer_sync = buffers.Buffers(self.module, self.strategy.buffers, self.faults,
                                           self.comm.smesh.dp_group())
        self.buffer_sync.install(self)
        self.runtime.boundary.backward_listeners.append(self.params.attach_grads)
        self.runtime.boundary.zero_listeners.append(self.params.release_fp32_grads)
        self.runtime.boundary.forward_checks.append(self.params.require)
        self._shardc_keys = AnyKey()           # torch's key check walks here (`_fqn_modifiers`)
        # what the state-dict code reads, handed over (it never reads this module's fields)
        self.state_view = StateView(self.module, self.params, self.param_targets, self.names_of, self.comm,
                                    self.runtime.units, self.runtime.release, self.dtensors, self.buffer_sync,
                                    self.faults)
        install()

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
        step/boundary.py's [Note: accumulation]). `recurse` is accepted for FSDP2 compatibility."""
        self.runtime.boundary.set_requires_sync(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's spelling: backwards inside do not issue the step's gradient sync."""
        self.runtime.boundary.enter_no_sync()
        try:
            yield
        finally:
            self.runtime.boundary.exit_no_sync()

    # -- optimizer and gradients ----------------------------------------------------
    def optimizer(self, cls, param_groups=None, **kw) -> torch.optim.Optimizer:
        """`cls` over this module's trainable parameters (`param_groups` name them); the same
        as `cls(sm.parameters(), ...)` (runtime/step/optimizer.py [Note: adoption ...])."""
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
        return full.full_state_dict(self.state_view, rank0_only)

    def full_optim_state_dict(self, optimizer, rank0_only: bool = False) -> dict:
        """`optimizer`'s state as torch's layout keyed by parameter names, each state tensor
        of its parameter's full shape (what a single-process run's optimizer would hold).

        Collective, like `full_state_dict`."""
        self.runtime.boundary.complete_updates()
        return full.full_optim_state_dict(self.state_view, optimizer, rank0_only)

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
        return checkpoint.model_state_dict(self.state_view)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load `state_dict()`-shaped (or full-tensor) entries; checks every name and shape
        before changing anything. Collective (re-gathers the params shards)."""
        self.runtime.boundary.complete_updates()
        self.faults.enter("load_state_dict()")
        return checkpoint.load_model_state_dict(self.state_view, state_dict, strict)

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


def shard_module(model: nn.Module, strategy: Strategy, units: list[UnitSpec], mesh=None,
                 hooks: bool = True, schedule: Schedule | None = None,
                 timeout: float | None = None, passes=None, lowering: Lowering | None = None,
                 backend: str = "eager", init=None, device=None, rng=None) -> ShardedModule:
    """Shard `model` per `strategy` over its `units` (root first); see docs/internals.md.

    `lowering`: the plan of these units (the compiler's `Lowering`, which `shardc.compile`
    hands over); without one it is lowered here, once, with the plan passes named in
    `passes` (None: all). `schedule` (default: the lowering's) says which gathers are issued
    before each unit runs, forward and backward; it replaces the lowering's, so
    `sm.lowering.schedule` is what the engine follows (`sm.schedule`). With `hooks=False`
    the caller's forward issues the forward gathers itself (emitted code), so the schedule
    must have no forward stages (the engine follows only the backward stages). `timeout`
    (seconds; default $SHARDC_TIMEOUT or 600) bounds every wait on a peer. `backend="inductor"`
    is the whole-step compiled mode (runtime/graph/mode.py): each micro-batch one compiled
    graph, forward and backward joined, and the step boundary one more. `init` (a model on
    the meta device): a function called per module, in `model.apply`'s order (default: each
    module's `reset_parameters()`), or False (no values: load them); `device`: where the
    shards live (default: the model's, or the mesh's for a model on meta); `rng`: the RNG
    state to initialize from (runtime/state/init.py; default: as it is)."""
    return ShardedModule(build(model, strategy, units, mesh=mesh, hooks=hooks, schedule=schedule,
                               timeout=timeout, passes=passes, lowering=lowering, backend=backend,
                               init=init, device=device, rng=rng))
