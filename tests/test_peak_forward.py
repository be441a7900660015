"""explain's forward point against torch's MemTracker in `shardc simulate` (issue 47), 64
tokens a micro-batch, rank 0.

analysis/costmodel/timeline.py [Note: timeline: forward's end]: the runtime releases the last
unit as soon as it ran, so the logits and the loss are made beside the root alone; and a
unit's peak is as it has run, its saved tensors made beside its window and the unit
gathered ahead. [Note: timeline: update gathers]: a deferred update is owed in the step's
first forward only, which holds no grad shard.

- MiCS, one micro-batch, HF Llama (bench/peak_models.py `llama_small`) on node(2) > gpu(4):
  with the last unit's window counted beside the loss's tensors explain's forward was
  1.047 of the measured one.
- MiCS, one micro-batch, examples/gpt.py `small` on node(1) > gpu(4): without the point as
  each unit has run it was 0.945 (the peak is as block 2 has run, block 3 gathered ahead).
- ZeRO-topo (deferred updates, 4 micro-batches), HF Llama on node(2) > gpu(2) > gcd(2): with
  the owed update gathers counted beside every grad shard it was 1.034.

Each fails if its part of the rule is undone: explain's forward must be within 3 % of the
measured forward, both ways. The states and the ledger equal explain's and the peak is not
under it; the peak is not asserted within 3 % both ways here: MiCS on examples/gpt.py `small`
is 1.031 over at the backward (the point while a unit's backward runs counts its saved
tensors and its gradient whole, a bound, docs/explain.md), which simulate's two-sided check
reports with exit status 1.
"""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 0.03          # shardc/simulate.py PEAK_TOLERANCE, both ways here
LLAMA = os.path.join(ROOT, "bench", "peak_models.py") + ":llama_small"
CASES = {     # (strategy, model, world, mesh, micro-batches)
    "mics-hf-llama-8": ("mics", LLAMA, "8", "node(2) > gpu(4)", "1"),
    "mics-gpt-small-4": ("mics", os.path.join(ROOT, "examples", "gpt.py") + ":small", "4", "node(1) > gpu(4)", "1"),
    "zero_topo-hf-llama-8": ("zero_topo", LLAMA, "8", "node(2) > gpu(2) > gcd(2)", "4"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_within_three_percent(case):
    name, model, world, mesh, micro_batches = CASES[case]
    if "peak_models" in model:
        pytest.importorskip("transformers", reason="the HF Llama factory needs transformers (a test extra)")
    from shardc.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["simulate", os.path.join(ROOT, "examples", "strategies", f"{name}.shard"), "--model", model,
                   "--world", world, "--mesh", mesh, "--rank", "0", "--micro-batches", micro_batches,
                   "--tokens", "64", "--json"])
    rep = json.loads(out.getvalue())[0]
    peak = rep["peak"]
    assert rep["memory_equal"] and rep["ledger_equal"] and peak["measured"] <= (1 + TOLERANCE) * peak["explain"]
    assert rc == (0 if peak["within"] else 1)
    measured, explained = peak["phases"]["forward"], peak["explain_phases"]["forward"]
    assert abs(explained - measured) <= TOLERANCE * measured, (case, explained, measured)
