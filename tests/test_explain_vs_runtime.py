"""`explain` predicts what the runtime measures: for every named strategy, on small
LLaMA-shaped models whose sizes need padding (and one with frozen parameters), the
predicted ledger equals `comm_ledger()` record for record after one real step with 2
micro-batches and `clip_grad_norm_`, and predicted memory equals `memory_report()`.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import os

import pytest

from tests.harness import dist_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMED = sorted(os.path.basename(p)[:-6] for p in glob.glob(os.path.join(ROOT, "examples/strategies/*.shard")))
MESH4 = "node(2) > gpu(2)"
MESH8 = "node(2) > gpu(2) > gcd(2)"
MEMORY_KEYS = ("params", "params_secondary", "grads", "optim", "total")
pytestmark = pytest.mark.distributed


# Per-unit scopes: block 0 keeps its own (smaller) scopes, so its records differ from the
# other units' and clip_grad_norm_ all-reduces over two distinct optimizer level sets.
OVERRIDE = """strategy override_mix
mesh node(*) > gpu(local)
params shard over gpu
grads  shard over world
optim  shard over world
override "layers.0" {
  params replicate
  grads  shard over gpu
  optim  shard over gpu
}
"""


def _strategy(name: str, mesh: str):
    import shardc
    if name.startswith("plan:"):     # "plan:I:DTYPE": the planner's I-th scope assignment
        from shardc.analysis.planner import enumerate_scopes
        from shardc.dsl.ir import DType
        _, i, dtype = name.split(":")
        base = shardc.load_strategy(f"strategy p{i}\nmesh {mesh}\naccumulate 2\n")
        return dataclasses.replace(base, scopes=enumerate_scopes(base.mesh, DType(dtype))[int(i)])
    src = OVERRIDE if name == "override_mix" else os.path.join(ROOT, "examples/strategies", name + ".shard")
    s = shardc.load_strategy(src, mesh=mesh)
    return dataclasses.replace(s, accumulate=2)


def _model(frozen: bool):
    import torch
    from shardc.cli.loader import load_factory
    factory = load_factory(os.path.join(ROOT, "examples/llama.py") + ":llama_tiny")
    torch.manual_seed(0)
    m = factory()
    if frozen:   # a frozen group in the root (embedding) and in every block (the attention norm)
        m.embed.weight.requires_grad_(False)
        for layer in m.layers:
            layer.attn_norm.weight.requires_grad_(False)
    return m


def _measure(rank, world, cases):
    """On every rank: one optimizer step (2 micro-batches, clip) per case; rank 0's figures."""
    import torch
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.runtime import shard_module
    from shardc.units import find_units

    out = []
    for name, mesh, frozen in cases:
        s = _strategy(name, mesh)
        model = _model(frozen)
        sm = shard_module(model, s, find_units(model, resolve_bucket(model, s)))
        opt = sm.optimizer(torch.optim.AdamW, lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            x = torch.randint(0, 101, (2, 8), generator=g)
            (sm(x).float().pow(2).mean() / 2).backward()
        sm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        ledger = [(r.phase, r.op, tuple(r.levels), r.bytes, r.count) for r in sm.comm_ledger()]
        out.append((ledger, dict(sm.memory_report())))
    return out


def _predict(name, mesh, frozen):
    from shardc.analysis.costmodel import predict_ledger, predict_memory
    from shardc.analysis.costmodel.report import model_units
    s = _strategy(name, mesh)
    units = model_units(s, _model(frozen))
    ledger = [(r.phase, r.op, tuple(r.levels), r.bytes, r.count)
              for r in predict_ledger(s, units, micro_batches=2, clip_grad_norm=True)]
    return ledger, predict_memory(s.mesh, units, optimizer="adamw")


@functools.lru_cache(maxsize=None)
def _measured(cases, world):
    measured = dist_run(world, _measure, list(cases))
    for rank_results in measured[1:]:      # every rank measures the same sizes
        assert [m for _, m in rank_results] == [m for _, m in measured[0]]
    return measured[0]


def _compare(cases, world, *, memory=True):
    for (name, mesh, frozen), (ledger, mem) in zip(cases, _measured(tuple(cases), world)):
        p_ledger, p_memory = _predict(name, mesh, frozen)
        assert p_ledger == ledger, f"{name} (frozen={frozen}) on {mesh}"
        if memory:
            assert {k: p_memory[k] for k in MEMORY_KEYS} == {k: mem[k] for k in MEMORY_KEYS}, name


def test_named_strategies_two_levels():
    cases = [(n, MESH4, False) for n in NAMED if n != "zero_topo"]
    cases += [("paro_iig", MESH4, True), ("zeropp", MESH4, True), ("ddp", MESH4, True),
              ("override_mix", MESH4, False)]
    assert len(cases) >= 14
    _compare(cases, 4)


def test_every_planner_assignment_in_bf16():
    # All 16 dependency-rule assignments on node(2) > gpu(2), bf16 params and grads (comm bf16):
    # an fp32 master in the optimizer (+4 bytes per OS element), bf16 sync/update payloads.
    _compare([(f"plan:{i}:bf16", MESH4, i % 5 == 0) for i in range(16)], 4)


TOPO = (("zero_topo", MESH8, False), ("zero_topo", MESH8, True), ("paro_igg", MESH8, False))


def test_three_levels_with_quantized_secondary():
    _compare(TOPO, 8)
