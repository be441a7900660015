"""The schedule the compiler prints is the schedule that runs.

The engine's recorded gather issues and unit runs (forward and backward) equal the
lowered plan's `Schedule.events()` for an fx-captured model (examples/gpt.py) and an
export-captured one (Hugging Face GPT-2, tiny config, run under the runtime's hooks);
editing an emitted module's schedule — SCHEDULE on the hooks path, the forward's
`rt.issue_gather` placement with fx (whose SCHEDULE holds the backward stages only, so
nothing printed is dead) — changes the recorded run accordingly.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from examples.gpt import GPT, GPTConfig
from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import STATES
from shardc.lowering import Schedule, Stage
from tests.harness import dist_run

pytestmark = pytest.mark.distributed
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
TEXT = "\n".join(["mesh node(2) > gpu(2)", *(f"{state} shard over world" for state in STATES),
                  "prefetch 1", ""])
KINDS = ("issue_gather", "run", "backward")
NO_PREFETCH_FORWARD = {  # the emitted prefetch-1 stages -> each unit issues its own gather just before it runs
    "Stage(unit=0, issue=(0, 1)),": "Stage(unit=0, issue=(0,)),",
    "Stage(unit=1, issue=(2,)),": "Stage(unit=1, issue=(1,)),",
    "Stage(unit=2, issue=()),": "Stage(unit=2, issue=(2,)),",
}
NO_PREFETCH_BACKWARD = {
    "Stage(unit=2, issue=(2, 1)),": "Stage(unit=2, issue=(2,)),",
    "Stage(unit=1, issue=()),": "Stage(unit=1, issue=(1,)),",
}


# The fx edit moves the forward's `rt.issue_gather(2)` from before unit 1 to right before unit 2.
FX_EDITED_FORWARD = (Stage(0, (0, 1)), Stage(1, ()), Stage(2, (2,)))


def _edit(src: str, capture: str) -> str:
    edits = NO_PREFETCH_BACKWARD | (NO_PREFETCH_FORWARD if capture == "export" else {})
    for old, new in edits.items():
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    if capture == "fx":         # SCHEDULE holds no forward stage: nothing there to edit
        assert "forward=()," in src and "Stage(unit=0" not in src         # move the forward's prefetch of unit 2 to right before its wait
        lines = src.splitlines(keepends=True)
        issue = next(i for i, ln in enumerate(lines) if "rt.issue_gather(2)" in ln)
        moved = lines.pop(issue)
        wait = next(i for i, ln in enumerate(lines) if "rt.wait_gather(2)" in ln)
        lines.insert(wait, moved)
        src = "".join(lines)
    return src


def _step(sm, x):
    sm.runtime.events.clear()
    logits = sm(x)
    logits = getattr(logits, "logits", logits)
    F.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
    return [e for e in sm.runtime.events if e[0] in KINDS]


def _gpt(rank, world, capture, edit):
    from shardc.api import load_emitted
    from shardc.compiler.api import compile_source
    torch.manual_seed(0)
    model = GPT(CFG)
    x = torch.randint(0, CFG.vocab_size, (2, 8))
    src, plan = compile_source(model, TEXT, example_inputs=(x,), capture=capture)
    src = _edit(src, capture) if edit else src
    ns = load_emitted(src, f"sched_{capture}_{edit}")
    if capture == "fx" and not edit:   # forward stages given to a forward that issues its own: refused
        from shardc.runtime import shard_module
        with pytest.raises(ShardcError, match="without forward stages"):
            shard_module(GPT(CFG), ns["STRATEGY"], ns["UNITS"], hooks=False, schedule=plan.lowering.schedule)
    sm = ns["shard_model"](model)
    return _step(sm, x), sm.schedule, plan.lowering.schedule, ns["SCHEDULE"]


def _engine_reads(planned: Schedule, capture: str) -> Schedule:
    """What the engine follows: all of it on the hooks path, the backward stages with fx."""
    return planned if capture == "export" else replace(planned, forward=())


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_edited_schedule_changes_the_run(capture):
    for (ev, ran, planned, emitted), (ev2, ran2, _, emitted2) in zip(
            dist_run(4, _gpt, capture, False), dist_run(4, _gpt, capture, True)):
        assert ran == emitted == _engine_reads(planned, capture)   # what runs is what the compiler lowered
        assert ev == planned.events()
        assert ev[:4] == [("issue_gather", 0), ("issue_gather", 1), ("issue_gather", 2), ("run", 1)]
        assert ran2 == emitted2 != ran                   # the edit reached the runtime ...
        forward = emitted2.forward if capture == "export" else FX_EDITED_FORWARD
        assert ev2 == replace(emitted2, forward=forward).events()   # ... and the run follows it
        assert ev2[:5] == [("issue_gather", 0), ("issue_gather", 1), ("run", 1), ("issue_gather", 2), ("run", 2)]
        bwd = ev2[ev2.index(("run", 2)) + 1:]
        assert bwd == [("issue_gather", 2), ("backward", 2), ("issue_gather", 1), ("backward", 1)]


def _hf(rank, world):
    import shardc
    from tests.test_hf_models import make_model
    model = make_model("gpt2")            # default config: cache on, ModelOutput returned
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    sm = shardc.compile(model, TEXT, example_inputs=(x,))
    return sm.plan.capture, _step(sm, x), sm.schedule, sm.plan.lowering.schedule


def test_hf_gpt2_export_capture_runs_the_plan_schedule():
    for capture, ev, ran, planned in dist_run(4, _hf):
        assert capture == "export"
        assert ran == planned
        assert ev == planned.events()
        assert ("issue_gather", 2) in ev and ("backward", 1) in ev
