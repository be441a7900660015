"""`comm` follows `dtype` unless stated: real `.shard` text with `dtype bf16` and no `comm`
sends 2-byte payloads — in the resolved IR, in `shardc explain --json` (LLaMA-7B on the
meta device) and in a gloo run's ledger. Expected bytes come from docs/internals.md's
formulas (payload = padded elements × bytes per element), not from the implementation.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import dist_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = """strategy bf16_zero3
mesh node(2) > gpu(2)
params shard over world dtype bf16
grads  shard over world dtype bf16
optim  shard over world
accumulate 2
"""
STATED = BF16.replace("params shard over world", "params shard over world comm fp32")
# LLaMA-7B: root = embed + head + final norm, a block = attention + SwiGLU + 2 norms.
ROOT_7B, BLOCK_7B = 2 * 32000 * 4096 + 4096, 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
# llama_tiny (root 3654, block 3330) padded to L = lcm(4, 4, 4) = 4 elements.
ROOT_TINY, BLOCK_TINY = 3656, 3332


def test_resolved_comm_is_the_dtype():
    from shardc import load_strategy
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.dsl.ir import DType
    s = load_strategy(BF16)
    assert s.scopes.params.comm is DType.BF16 and s.scopes.grads.comm is DType.BF16
    t = load_strategy(STATED)
    assert t.scopes.params.comm is DType.FP32 and t.scopes.params.dtype is DType.BF16
    assert load_strategy(BF16.replace("dtype bf16", "")).scopes.params.comm is DType.FP32


def _explain(tmp_path, text):
    """`shardc explain --json`, run in this process (the CLI's own entry point)."""
    import contextlib
    import io

    from shardc.cli import main
    f = tmp_path / "s.shard"
    f.write_text(text.replace("node(2) > gpu(2)", "node(8) > gpu(8)"))
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["explain", str(f), "--model", "examples/llama.py:llama_7b", "--json"])
    finally:
        os.chdir(cwd)
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


def _sizes(ledger, phase, op):
    return {r["bytes"] for r in ledger if r["phase"] == phase and r["op"] == op}


def test_explain_json_counts_bf16_payloads(tmp_path):
    doc = _explain(tmp_path, BF16)
    assert _sizes(doc["ledger"], "forward", "all_gather") == {2 * ROOT_7B, 2 * BLOCK_7B}
    assert _sizes(doc["ledger"], "backward", "reduce_scatter") == {2 * ROOT_7B, 2 * BLOCK_7B}
    stated = _explain(tmp_path, STATED)
    assert _sizes(stated["ledger"], "forward", "all_gather") == {4 * ROOT_7B, 4 * BLOCK_7B}
    assert _sizes(stated["ledger"], "backward", "reduce_scatter") == {2 * ROOT_7B, 2 * BLOCK_7B}


def _step(rank, world, text):
    import torch
    from shardc import load_strategy
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.cli.loader import load_factory
    from shardc.runtime import shard_module
    from shardc.units import find_units
    s = load_strategy(text)
    torch.manual_seed(0)
    model = load_factory(os.path.join(ROOT, "examples/llama.py") + ":llama_tiny")()
    sm = shard_module(model, s, find_units(model, resolve_bucket(model, s)))
    opt = sm.optimizer(torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        (sm(torch.randint(0, 101, (2, 8), generator=g)).float().pow(2).mean()).backward()
    opt.step()
    return [(r.phase, r.op, r.bytes, r.count) for r in sm.comm_ledger()]


@pytest.mark.distributed
def test_gloo_ledger_sends_bf16():
    ledger = dist_run(4, _step, BF16, timeout=600)[0]
    rows = {(p, op, b): c for p, op, b, c in ledger}
    assert rows == {
        ("forward", "all_gather", 2 * ROOT_TINY): 2, ("forward", "all_gather", 2 * BLOCK_TINY): 4,
        ("backward", "all_gather", 2 * BLOCK_TINY): 4,
        ("backward", "reduce_scatter", 2 * ROOT_TINY): 2, ("backward", "reduce_scatter", 2 * BLOCK_TINY): 4}
