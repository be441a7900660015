"""The runtime runs the plan the compiler made: one `Lowering` from `lower()` to the engine.

paro_iig on node(2) > gpu(2) with the plan passes narrowed to `early_sync` (`shardc
compile --passes early_sync`, `shardc.compile(..., passes=("early_sync",))`): the full
pass list would also defer every unit's update all-gather (`defer_update`), so a runtime
that lowered again with every pass would disagree with the emitted SCHEDULE. On both
routes — `shardc.compile` in memory, and `shardc compile -o` then the file's
`shard_model` — the schedule the engine follows, `sm.schedule` and `sm.lowering.schedule`
are one: the emitted SCHEDULE, and what `explain --passes early_sync` lowered (with fx
capture the forward stages are the emitted forward's issue calls, so SCHEDULE holds
`forward=()`). `shardc.compile` hands the compiler's plan over (the runtime lowers
nothing; its units are the compiler's very object); the file's `shard_model` lowers once,
with the file's PLAN_PASSES. A training step then defers no update. `shard_model`'s
keywords reach the run: `schedule=` replaces SCHEDULE in `sm.lowering` too, `timeout=`
sets the module's timeout, and a `lowering=` that plans other units is refused.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

import shardc
from shardc.dsl.errors import ShardcError
from tests.harness import HANG_S, dist_run
from tests.test_compile_parity import ROOT, STRAT, batches, make_model, make_opt, train

pytestmark = pytest.mark.distributed
MESH = "node(2) > gpu(2)"
ONLY = ("early_sync",)


def _explained(passes, file="paro_iig.shard"):
    """The plan `shardc explain --passes ...` adds up (the CLI's loader and explain)."""
    from shardc.analysis.costmodel.report import explain
    from shardc.cli.loader import load_model_units
    strategy = shardc.load_strategy(os.path.join(STRAT, file), mesh=MESH)
    return explain(strategy, load_model_units(strategy, "examples/gpt.py:tiny"), passes=passes).plan


def _counting_lower():
    """Count the runtime's calls of `lower` (restored by the returned function)."""
    import shardc.runtime.build as module
    calls, original = [], module.lower
    module.lower = lambda *a, **kw: calls.append(1) or original(*a, **kw)

    def restore():
        module.lower = original
        return len(calls)
    return restore


def _one_step(sm, rank, world):
    """One optimizer step; the update all-gathers still deferred after it."""
    o = make_opt("sgd", sm)
    opt = sm.optimizer(o.pop("cls"), **o)
    acc = sm.strategy.accumulate
    train(sm, opt, batches(world, acc)[:1], rank, world, acc)
    return sm.runtime.boundary.pending_updates()


def _job(rank, world, path, other):
    import importlib.util
    from shardc.api import load_emitted
    out = {}
    strategy = shardc.load_strategy(os.path.join(STRAT, "paro_iig.shard"), mesh=MESH)
    restore = _counting_lower()
    sm = shardc.compile(make_model(), strategy, capture="fx", passes=ONLY)
    lowered = restore()
    out["compile"] = dict(engine=sm.runtime.schedule, sm=sm.schedule, lowering=sm.lowering.schedule,
                          emitted=load_emitted(sm.source, "handoff")["SCHEDULE"], planned=sm.plan.lowering.schedule,
                          same_units=sm.lowering.units is sm.plan.lowering.units, lowered=lowered,
                          pending=_one_step(sm, rank, world))
    spec = importlib.util.spec_from_file_location(f"handoff_{rank}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    restore = _counting_lower()
    sm = mod.shard_model(make_model())
    lowered = restore()
    out["file"] = dict(engine=sm.runtime.schedule, sm=sm.schedule, lowering=sm.lowering.schedule,
                       emitted=mod.SCHEDULE, passes=mod.PLAN_PASSES, units=sm.lowering.units, lowered=lowered,
                       pending=_one_step(sm, rank, world))
    edited = dataclasses.replace(mod.SCHEDULE, sync_early=())
    sm = mod.shard_model(make_model(), schedule=edited, timeout=123.0)
    out["kwargs"] = (sm.runtime.schedule, sm.lowering.schedule, sm.faults.timeout)
    with pytest.raises(ShardcError, match=r"the lowering given to shard_module does not plan unit 0 \('<root>'\)"):
        mod.shard_model(make_model(), lowering=other)
    return out


def test_the_run_follows_the_compilers_plan(tmp_path):
    path = tmp_path / "gpt_paro_iig.py"
    r = subprocess.run([sys.executable, "-m", "shardc.cli", "compile", "examples/strategies/paro_iig.shard",
                        "--model", "examples/gpt.py:tiny", "--mesh", MESH, "--passes", ",".join(ONLY),
                        "-o", str(path)], capture_output=True, text=True, cwd=ROOT, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    explained = _explained(ONLY)
    assert explained.schedule.sync_early and explained.schedule.update_deferred == ()
    assert _explained(None).schedule.update_deferred                       # what the full list would add
    fx = dataclasses.replace(explained.schedule, forward=())              # SCHEDULE with fx capture
    other = _explained(None, "zero3.shard")                               # other scopes, same units
    for out in dist_run(4, _job, str(path), other):
        c, f = out["compile"], out["file"]
        assert c["engine"] == c["sm"] == c["lowering"] == c["emitted"] == fx
        assert c["planned"] == explained.schedule                         # the compiler's, forward included
        assert c["same_units"] and c["lowered"] == 0                      # handed over, not lowered again
        assert f["engine"] == f["sm"] == f["lowering"] == f["emitted"] == fx
        assert f["passes"] == ONLY and f["lowered"] == 1                  # lowered once, with the file's passes
        assert f["units"] == explained.units                              # the rows explain added up
        assert c["pending"] == f["pending"] == []                         # no update deferred
        engine, lowering, timeout = out["kwargs"]
        assert engine == lowering == dataclasses.replace(fx, sync_early=()) and timeout == 123.0
