"""Simulation — stage: public API. One process runs the real `shardc.compile` and runtime
as rank r of an N-rank job, so a job of 1024 ranks and a 65B model is checked on one CPU.

Input: a resolved `Strategy` (its mesh names the world), a model factory (a zero-argument
callable, built on the meta device; the CLI loads it from `PATH.py:FACTORY`), the rank, the step (micro-batches of
`batch` x `seq` tokens, the optimizer class by name, whether `clip_grad_norm_` runs) and
optionally the model's traced graph for the predicted peak. Output: `simulate_rank`'s
report (a dict, what `shardc simulate --json` prints per rank).

[Note: what a simulated rank runs]
The default process group is torch's `fake` one (`init_process_group("fake",
store=FakeStore(), rank=r, world_size=N)`): every collective completes at once and moves
nothing. Inside `runtime.simulation.simulation()` (runtime/simulation.py) `shardc.compile`
traces the meta model, lowers the plan, builds the mesh's process groups, allocates the
shards as meta tensors (bytes without storage) and takes no values; then two steps run
as a training loop would: `micro_batches` forwards and backwards (a cross-entropy loss on
meta tokens, attention as the flash kernel and grouped matmuls of any dtype, as explain's
trace runs them), optionally
`clip_grad_norm_`, `opt.step()` with the torch optimizer class and `opt.zero_grad()`.
The first makes the optimizer's states (torch's optimizers make them at their first
step); the second, a step as every later one runs, is measured. Per rank:
  * model states: `memory_report()` (the tensors the runtime holds, the optimizer's states
    included) beside explain's `memory`, key by key;
  * the ledger: `comm_ledger()` of the measured step beside explain's, record by record
    (the same micro-batches and clip), and summed by mesh level set;
  * the peak during the step: torch's `MemTracker` (torch.distributed._tools.mem_tracker)
    over the step, with every tensor held before it registered as external (the runtime's
    storages and the gradients the optimizer reads, runtime/memory.py `held_tensors`, and
    the optimizer's states); beside it
    explain's peak without its framework overhead, which a tracker of tensors cannot see
    (the memory timeline's maximum, analysis/costmodel/timeline.py), and per phase
    explain's point for that phase (`explain_phases`, `phases_within`);
  * a factory with an `ep_mesh` parameter is called with
    this rank's 1-D ep DeviceMesh (runtime/transport/experts.py), on which it places its experts as
    DTensor Shard(0); explain's sizes are taken from a call with None (no process group
    exists yet: plain experts, counted on one ep rank);
  * seconds: building the mesh's process groups (`ShardMesh`, every group the plan uses,
    made before the compile, which then finds them cached), lowering the plan (`lower`
    on the model's units, timed once apart), `shardc.compile` (capture, lowering, codegen,
    construction) and the measured step. Wall seconds and the process's CPU seconds.

[Note: the loop drops the output before backward]
Each micro-batch's loop drops its references to the model's output (`out`, `logits`)
once the loss is computed, before `loss.backward()`, as torchtitan's trainer does
(`del pred` before the backward, "to avoid peaking memory") and as the FSDP2 loops this
runtime is compared with (bench/peak_fsdp2.py) do. Only autograd's saved tensors of the
loss (cross entropy's log-softmax) then outlive the forward; explain's timeline counts
what that leaves (analysis/costmodel/loss.py [Note: timeline: loss tensors]).
"""
from __future__ import annotations

import contextlib
import time

from shardc.dsl.errors import ShardcError

__all__ = ["simulate_rank", "check_rank", "init_fake", "meta_model", "FACTORY_NOT_META"]

STATE_KEYS = ("params", "params_secondary", "grads", "optim", "total")
# MemTracker's kinds as the report names them: what the runtime held before the step
# (registered as external: shards, grad shards, masters, the full buffers a gather refills,
# the gradients the optimizer reads), the optimizer's states, tensors made in the forward,
# in the backward
KINDS = {"Other": "held by the runtime", "Activation": "forward", "Temp": "backward", "Optstate": "optimizer states",
         "Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients"}
# the simulated rank's tensors: its step runs torch's optimizers on meta tensors, where they take
# their per-tensor loop, so explain's step temporaries are taken by that rule, what is measured
# (lowering/optimizers.py `step_impl`); a GPU run takes foreach (`shardc explain`)
DEVICE = "meta"
FACTORY_NOT_META = ("the model factory {spec} cannot build the model on the meta device ({why}); a simulated "
                    "rank builds it there (`with torch.device('meta'): model = factory()`), so create every "
                    "parameter without an explicit device and without reading values")


def check_rank(rank: int, world: int) -> None:
    if not 0 <= rank < world:
        raise ShardcError(f"rank {rank} is outside the world: the mesh has {world} ranks, 0..{world - 1}")


class _Clock:
    """Wall and CPU seconds of named phases."""

    def __init__(self):
        self.seconds: dict[str, dict[str, float]] = {}

    def __call__(self, name: str):
        clock = self

        class _Phase:
            def __enter__(self):
                self.w, self.c = time.perf_counter(), time.process_time()

            def __exit__(self, *exc):
                clock.seconds[name] = {"wall": time.perf_counter() - self.w, "cpu": time.process_time() - self.c}
        return _Phase()


def takes_ep_mesh(factory) -> bool:
    """Whether the factory has an `ep_mesh` parameter ([Note: what a simulated rank runs])."""
    import inspect
    try:
        return "ep_mesh" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def meta_model(factory, spec: str, ep_mesh=None):
    """`factory()`'s model on the meta device (`spec` names the factory in messages); one
    sentence when it cannot be built there. A factory that takes `ep_mesh` gets it."""
    import torch
    from torch import nn

    try:
        with torch.device("meta"):
            model = factory(ep_mesh=ep_mesh) if takes_ep_mesh(factory) else factory()
    except Exception as e:  # noqa: BLE001 — user code: one sentence, no traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ShardcError(FACTORY_NOT_META.format(spec=spec, why=f"it raised {type(e).__name__}: {first}")) from None
    if not isinstance(model, nn.Module):
        raise ShardcError(f"factory {spec} did not return an nn.Module (got {type(model).__name__})")
    real = next((n for n, t in [*model.named_parameters(), *model.named_buffers()]
                 if t.device != torch.device("meta")), None)
    if real is not None:
        raise ShardcError(FACTORY_NOT_META.format(spec=spec, why=f"{real!r} was created on {_where(model, real)}"))
    return model


def _where(model, name: str) -> str:
    t = dict([*model.named_parameters(), *model.named_buffers()])[name]
    return str(t.device)


def simulate_rank(strategy, factory, rank: int, *, spec: str = "the model factory", micro_batches: int | None = None,
                  optimizer: str = "adamw", clip: bool = False, batch: int = 1, seq: int = 2048, graph=None,
                  passes=None, peak: bool = True) -> dict:
    """Run one training step as rank `rank` of `strategy`'s mesh in this process (see the
    module note); the process must have no default process group (it makes the fake one,
    and leaves it). `graph`: the model's traced `GraphCost` for explain's peak (None: no
    predicted peak). `peak=False` runs one step, untracked: states and ledger only."""
    import torch.distributed as dist

    from shardc.analysis.costmodel.report import explain, model_units
    from shardc.lowering import RankPlan, lower
    from shardc.runtime.transport.mesh import ShardMesh

    world = strategy.mesh.world
    check_rank(rank, world)
    m = strategy.accumulate if micro_batches is None else micro_batches
    if m < 1:
        raise ShardcError(f"--micro-batches must be at least 1, got {m}")
    cls = _optimizer_class(optimizer)
    if dist.is_initialized():
        raise ShardcError("a simulated rank makes its own (fake) default process group, but this process "
                          "already has one; simulate in a fresh process")
    clock = _Clock()
    units = model_units(strategy, meta_model(factory, spec))   # what explain sizes
    predicted = explain(strategy, units, micro_batches=m, optimizer=optimizer, clip_grad_norm=clip,
                        graph=graph, passes=passes, device=DEVICE)
    init_fake(rank, world)
    try:
        with clock("groups"):
            smesh = ShardMesh(strategy.mesh, "cpu")
            for u in units:
                plan = RankPlan(strategy.mesh, u.scopes, smesh.rank)
                for lv in plan.groups():
                    if lv and plan.s(lv) > 1:
                        smesh.group(lv)
        with clock("lowering"):
            lower(strategy.mesh, units, strategy.prefetch, passes)
        model = meta_model(factory, spec, _ep_mesh(strategy, smesh) if takes_ep_mesh(factory) else None)
        measured = _run(strategy, model, m, cls, clip, batch, seq, passes, clock, peak)
    finally:
        dist.destroy_process_group()
    return _report(strategy, rank, m, optimizer, clip, batch, seq, predicted, measured, clock.seconds)


def _ep_mesh(strategy, smesh):
    """This rank's 1-D ep DeviceMesh under the strategy's `experts` statement (None without
    one, or with ep 1): the mesh the runtime checks the experts against."""
    from shardc.lowering import expert_group
    from shardc.runtime.transport.experts import ep_device_mesh
    experts = expert_group(strategy)
    return ep_device_mesh(smesh, experts) if experts is not None and experts.ep > 1 else None


def _optimizer_class(name: str):
    import torch

    from shardc.lowering.optimizers import optimizer_kind
    kind = optimizer_kind(name)
    if kind is None or not hasattr(torch.optim, kind.name):
        raise ShardcError(f"unknown optimizer {name!r}; torch.optim has no such class")
    return getattr(torch.optim, kind.name)


def init_fake(rank: int, world: int) -> None:
    """The default process group: torch's fake one, as `rank` of `world`."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore   # registers the "fake" backend
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _run(strategy, model, m, cls, clip, batch, seq, passes, clock, track: bool) -> dict:
    import torch
    import torch.nn.functional as F
    import shardc
    from shardc.analysis.costmodel.flops import flash_sdpa_mode, meta_grouped_mm, sample_input
    from shardc.dtype_check import dtype_check
    from shardc.runtime.memory import held_tensors
    from shardc.runtime.simulation import simulation

    x = sample_input(model, batch, seq)
    with simulation():
        with clock("compile"):
            sm = shardc.compile(model, strategy, example_inputs=(x,), passes=passes)
        opt = sm.optimizer(cls)

        def step(phase):
            for _ in range(m):
                with phase("forward"):
                    out = sm(x)
                    logits = out if torch.is_tensor(out) else out[0]
                    loss = F.cross_entropy(logits.flatten(0, -2).float(), x.flatten()).div(m)
                    del out, logits             # [Note: the loop drops the output before backward]
                with phase("backward"):
                    loss.backward()
                del loss
            with phase("step"):                 # the sync's wait, clip, the update, the update gathers
                if clip:
                    sm.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
        if not track:
            with clock("step"), flash_sdpa_mode(), meta_grouped_mm(), dtype_check(model):
                step(_no_phase)
            peak = None
        else:
            with flash_sdpa_mode(), meta_grouped_mm(), dtype_check(model):   # [Note: meta kernels do not check dtypes]
                step(_no_phase)                 # the first step makes the optimizer's states
            sm.reset_comm_ledger()
            tracker = _step_tracker()
            tracker.track_external(*held_tensors(sm.runtime, sm.params), opt)
            with clock("step"), tracker, flash_sdpa_mode(), meta_grouped_mm():
                step(tracker.phase)             # a step as every later one runs: measured, phase by phase
            peak = {"by_kind": tracker.peak_by_kind(), "phases": tracker.phase_peaks()}
        ledger = [dict(phase=r.phase, op=r.op, levels=list(r.levels), bytes=r.bytes, count=r.count)
                  for r in sm.comm_ledger()]
        return {"memory": dict(sm.memory_report()), "ledger": ledger, "peak": peak,
                "strategy": sm.plan.strategy}


@contextlib.contextmanager
def _no_phase(name):
    yield


PHASES = ("forward", "backward", "step")


def _step_tracker():
    """torch's MemTracker keeping the step's peak, per phase (`PHASES`: each micro-batch's
    forward with the loss, its backward, and the step — the sync's wait, clip, the update
    and its gathers —, the largest over micro-batches). Its per-module bookkeeping is left out:
    its module hooks read every parameter's `.grad` before each forward (on a shardc model
    reading a gradient completes the step's sync: the run would change), and its per-module
    peaks walk every module seen so far on every operator (minutes for 80 layers). What it
    counts is unchanged: every tensor an operator makes, every storage resize, the tensors
    registered as external, the optimizer's states."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class StepPeak(MemTracker):
        phases: dict

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

        @contextlib.contextmanager
        def phase(self, name: str):
            """The peak of this span (from what is held as it starts) kept under `name`."""
            self._peak_mem = {d: s[_TOTAL_KEY] for d, s in self._curr_mem_snap.items()}
            self._peak_mem_snap = {d: dict(s) for d, s in self._curr_mem_snap.items()}
            yield
            snap = next(iter(self._peak_mem_snap.values()), {})
            phases = self.__dict__.setdefault("phases", {})
            if snap.get(_TOTAL_KEY, 0) >= phases.get(name, {}).get(_TOTAL_KEY, -1):
                phases[name] = snap

        def phase_peaks(self) -> dict:
            """{phase: bytes at its peak}, in PHASES order."""
            got = self.__dict__.get("phases", {})
            return {n: int(got[n].get(_TOTAL_KEY, 0)) for n in PHASES if n in got}

        def peak_by_kind(self) -> dict:
            """MemTracker's kinds (and "Total") at the step's peak: the largest phase's."""
            got = list(self.__dict__.get("phases", {}).values())
            snap = max(got, key=lambda s: s.get(_TOTAL_KEY, 0)) if got else {}
            return {getattr(k, "value", k): v for k, v in snap.items()}

        def _pre_fw_hook(self, module, inputs) -> None:
            pass

        def _post_fw_hook(self, module, inputs, outputs) -> None:
            pass

        def _pre_bw_hook(self, module, args) -> None:
            pass

        def _post_bw_hook(self, module, args) -> None:
            pass
    return StepPeak()


def _report(strategy, rank, m, optimizer, clip, batch, seq, predicted, measured, seconds) -> dict:
    from shardc.analysis.costmodel.ledger import ledger_dicts
    p_memory = {k: int(predicted.memory[k]) for k in STATE_KEYS}
    memory = {k: int(measured["memory"][k]) for k in STATE_KEYS}
    p_ledger = ledger_dicts(predicted.ledger)
    ledger = measured["ledger"]
    peak = predicted.peak
    return {
        "strategy": strategy.name, "mesh": str(strategy.mesh), "world": strategy.mesh.world, "rank": rank,
        "coords": dict(zip(strategy.mesh.names, _coords(strategy.mesh, rank))),
        "params": sum(u.trainable + u.frozen for u in predicted.units),
        "step": {"micro_batches": m, "batch": batch, "seq": seq, "optimizer": optimizer, "clip": clip},
        "memory": memory, "explain_memory": p_memory, "memory_equal": memory == p_memory,
        "ledger": ledger, "explain_ledger": p_ledger, "ledger_equal": _normal(ledger) == _normal(p_ledger),
        "ledger_by_levels": by_levels(ledger),
        "peak": {"measured": None if measured["peak"] is None else int(measured["peak"]["by_kind"].get("Total", 0)),
                 "by_kind": {KINDS.get(k, k): int(v) for k, v in (measured["peak"] or {}).get("by_kind", {}).items()
                             if k != "Total"},
                 "phases": (measured["peak"] or {}).get("phases", {}),
                 "phase": _largest((measured["peak"] or {}).get("phases", {})),
                 "tracker": "torch.distributed._tools.mem_tracker.MemTracker",
                 "explain": None if peak["peak"] is None else peak["peak"] - peak["overhead"],
                 "explain_parts": {k: peak[k] for k in ("states", "gathered", "activations")},
                 "within": _within(measured["peak"], peak),
                 "explain_phase": peak.get("phase"), "explain_buffers": peak.get("buffers"),
                 "explain_timeline": peak.get("timeline"),
                 "explain_phases": _explain_phases(peak.get("timeline")),
                 "phases_within": _phases_within((measured["peak"] or {}).get("phases", {}),
                                                 _explain_phases(peak.get("timeline")))},
        "seconds": seconds,
    }


# explain's peak may be this far from the measured one, either way, before simulate calls it
# a miss (issue 47's goal): a peak predicted low lets a job that does not fit through, one
# predicted high turns a layout that fits away. A phase's figure is checked one way only
# (`_phases_within`): the peak's point is one bound of several, a non-peak phase's may be looser.
PEAK_TOLERANCE = 0.03


def peak_within(measured: int | None, explained: int | None) -> bool | None:
    """explain's peak (without its framework overhead) is within PEAK_TOLERANCE of the measured
    one, either way (None: either is unknown)."""
    if measured is None or explained is None:
        return None
    return abs(explained - measured) <= PEAK_TOLERANCE * measured


def _within(measured, peak) -> bool | None:
    if measured is None or peak["peak"] is None:
        return None
    return peak_within(measured["by_kind"].get("Total", 0), peak["peak"] - peak["overhead"])


def peak_miss(report: dict) -> str | None:
    """One sentence for a rank whose peak misses explain's (`within` False), naming the
    phases and both figures; None when it does not miss."""
    pk = report["peak"]
    if pk.get("within") is not False:
        return None
    m, e = pk["measured"], pk["explain"]
    side = "above" if m > e else "below"
    return (f"rank {report['rank']}: the measured peak, {m:,} B in the {pk['phase']}, is {abs(m - e) / e:.1%} "
            f"{side} explain's {e:,} B at the {pk['explain_phase']} (the tolerance is "
            f"{PEAK_TOLERANCE:.0%} either way)")


def _explain_phases(timeline) -> dict:
    """explain's bytes for each measured phase (`PHASES`): the largest of the timeline's
    points that phase spans (analysis/costmodel/timeline.py `MEASURED`: the step-end sync is
    issued inside the backward)."""
    from shardc.analysis.costmodel.timeline import MEASURED
    if not timeline:
        return {}
    at = {p["phase"]: p["bytes"] for p in timeline}
    return {ph: max(at[p] for p in MEASURED[ph] if p in at) for ph in PHASES}


def _phases_within(measured: dict, explained: dict) -> dict:
    """{phase: the measured peak is no more than PEAK_TOLERANCE above explain's}."""
    return {ph: measured[ph] <= (1 + PEAK_TOLERANCE) * explained[ph] for ph in measured if ph in explained}


def _largest(phases: dict) -> str | None:
    return max(phases, key=phases.get) if phases else None


def _coords(mesh, rank: int):
    from shardc.lowering import coords
    return coords(mesh, rank)


def _normal(ledger) -> list:
    return [(r["phase"], r["op"], tuple(r["levels"]), r["bytes"], r["count"]) for r in ledger]


def by_levels(ledger) -> dict[str, int]:
    """Bytes per step by the level set a collective spans (bytes x count)."""
    out: dict[str, int] = {}
    for r in ledger:
        key = ",".join(r["levels"])
        out[key] = out.get(key, 0) + r["bytes"] * r["count"]
    return out
