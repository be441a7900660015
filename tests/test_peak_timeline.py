"""explain's peak is the runtime's memory timeline (analysis/costmodel/timeline.py), checked
against torch's MemTracker in `shardc simulate` (GPT tiny as rank 0 of 4, one micro-batch).

explain's peak (without the framework overhead) must be at least 99 % of the measured peak
and at most 10 % above it. After peak-runtime changed the runtime's buffers (REDUCE_IN_FLIGHT
= 1, grad shards freed by zero_grad(): lowering/transients.py) and before the timeline
followed (peak-reconcile), explain was 16 % (ddp: 794,160 B against 682,808) and 14 % (zero3:
619,376 against 543,480) above the measured peak here, and this test failed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _simulate(name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "shardc.cli", "simulate", os.path.join(ROOT, "examples", "strategies", f"{name}.shard"),
         "--model", os.path.join(ROOT, "examples", "gpt.py") + ":tiny", "--world", "4", "--mesh", "node(1) > gpu(4)",
         "--rank", "0", "--micro-batches", "1", "--tokens", "64", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def test_explain_peak_bounds_the_measured_peak():
    runs = {s: _simulate(s) for s in ("ddp", "zero3")}
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        doc = json.loads(out)
        peak = (doc[0] if isinstance(doc, list) else doc)["peak"]
        timeline = {p["phase"]: p for p in peak["explain_timeline"]}
        # explain's peak is the timeline's maximum, and it names that phase and its buffers
        top = max(timeline.values(), key=lambda p: p["bytes"])
        assert peak["explain"] == top["bytes"] and peak["explain_phase"] == top["phase"]
        assert sum(peak["explain_buffers"].values()) == top["bytes"]
        # the measured peak is the backward's, and so is explain's
        assert peak["phase"] == "backward" == peak["explain_phase"], (name, peak["phases"])
        assert peak["within"] is True          # simulate exits 0: not more than 3 % above explain's
        assert 0.99 * peak["measured"] <= peak["explain"] <= 1.10 * peak["measured"], (name, peak["explain"], peak["measured"])


def test_plan_memory_picks_a_layout_whose_measured_peak_fits(tmp_path):
    # The planner filters by the timeline's peak: its pick, simulated with its own
    # `accumulate`, measures no more than the limit (overhead 0: the tracker sees tensors).
    limit = 700_000
    best = tmp_path / "best.shard"
    model = os.path.join(ROOT, "examples", "gpt.py") + ":tiny"
    plan = subprocess.run([sys.executable, "-m", "shardc.cli", "plan", "--model", model, "--mesh", "node(1) > gpu(4)",
                           "--memory", f"{limit}B", "--overhead", "0", "--tokens", "64", "-o", str(best)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert plan.returncode == 0, plan.stderr
    sim = subprocess.run([sys.executable, "-m", "shardc.cli", "simulate", str(best), "--model", model, "--world", "4",
                          "--mesh", "node(1) > gpu(4)", "--rank", "0", "--tokens", "64", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert sim.returncode == 0, sim.stderr
    peak = json.loads(sim.stdout)[0]["peak"]
    assert peak["explain"] <= limit and peak["measured"] <= limit, peak
