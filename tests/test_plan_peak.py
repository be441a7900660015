"""`plan --memory M` against the simulated peak (issue 47 item 4): the layouts the planner
keeps run within M on a simulated rank, and the first layout it rejects would not fit.

A small HF GPT-2 (bench/peak_models.py, 875,264 parameters, tied head) on node(2) > gpu(2),
one micro-batch of 64 tokens, AdamW in fp32, no framework overhead. M is DDP's model states,
16 bytes a parameter (fp32 params and grads, two AdamW moments): every layout that fits must
shard something. `plan --json` names its top picks and the first layout it rejects (the
smallest peak over M); each is simulated as rank 0 by `shardc simulate` in this process
(torch's MemTracker over the real runtime under the fake process group). LLaMA-30B on 128
ranks under 80 GiB is the same check at scale: bench/plan_peak.py, docs/BENCHMARKS.md.
"""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "bench", "peak_models.py") + ":gpt2_small"
MESH, TOKENS = "node(2) > gpu(2)", "64"
TOP = 2


def _cli(argv: list[str]) -> tuple[int, object]:
    from shardc.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, json.loads(out.getvalue())


def test_plan_keeps_only_layouts_whose_simulated_peak_fits(tmp_path):
    pytest.importorskip("transformers", reason="the HF GPT-2 factory needs transformers (a test extra)")
    import sys
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import peak_models
    budget = 16 * sum(p.numel() for p in peak_models.gpt2_small().parameters())   # DDP's model states
    rc, doc = _cli(["plan", "--model", MODEL, "--mesh", MESH, "--memory", f"{budget}B", "--micro-batches", "1",
                    "--tokens", TOKENS, "--overhead", "0", "--top", str(TOP), "--json"])
    assert rc == 0 and 0 < doc["fit"] < doc["candidates"] == 16
    picks, rejected = doc["ranking"][:TOP], doc["rejected"]
    assert all(r["memory"] <= budget for r in picks) and rejected["memory"] > budget
    assert rejected["model_states"] < budget        # rejected by its transients, not by its states
    for n, r in enumerate([*picks, rejected]):
        path = tmp_path / f"layout{n}.shard"
        path.write_text(r["shard"])
        rc, got = _cli(["simulate", str(path), "--model", MODEL, "--mesh", MESH, "--rank", "0",
                        "--micro-batches", "1", "--tokens", TOKENS, "--json"])
        measured = got[0]["peak"]["measured"]
        assert rc == 0 and got[0]["peak"]["within"], (r["shard"], got[0]["peak"])
        if r is rejected:
            assert measured > budget, (r["shard"], measured, budget)
        else:
            assert measured <= budget, (r["shard"], measured, budget)
