"""`bucket` chosen by the cost model when the strategy has no `bucket` line.

The rule (analysis/costmodel/bucketing.py "[Note: when bucketing pays]"): the size is the
largest one up to V* = A/B (the message size at which a unit's collective is half
latency on the α–β model) that leaves at least prefetch + 2 non-root buckets, reported
as its largest bucket's bytes; 0 when that merges no two units. `bucket 0` turns it
off. Checked from the formulas, then with real .shard text through every stage: the
emitted module shows the size and the merged units, and the bucketed model trains at
parity with one process.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import shardc
from examples.gpt import TINY, GPT
from shardc.analysis.costmodel.bucketing import bucket_bytes, crossover_bytes
from shardc.analysis.costmodel.timing import AlphaBeta
from shardc.compiler.api import compile_source
from tests.harness import dist_run
from tests.test_compile_parity import batches, eval_loss, train

TEXT = """mesh node(2) > gpu(2)
params shard over world
grads  shard over world
optim  shard over world
accumulate 2
"""
# TINY blocks: c_attn 32·96 + c_proj 32·32+32 + 2 LayerNorms 4·32 + c_fc 32·128+128 +
# c_proj 128·32+32 = 12608 elements = 50432 fp32 bytes.
BLOCK = 12608 * 4


def _flat_ring_crossover(p: int, nodes: int, ab: AlphaBeta) -> float:
    """A flat ring over p ranks on `nodes` nodes: A = (p−1)·α_inter; the inter link of a
    rank carries nodes/p · (p−1)/p of V at `inter` bytes/s (the slowest link), so
    B = nodes·(p−1)/(p²·inter) and V* = A/B = α_inter·inter·p²/nodes."""
    return ab.inter_lat * ab.inter * p * p / nodes


def test_crossover_from_alpha_beta():
    ab = AlphaBeta()
    for mesh, p in (("node(2) > gpu(2)", 4), ("node(2) > gpu(4)", 8)):
        s = shardc.load_strategy(TEXT, mesh=mesh)
        assert crossover_bytes(s) == pytest.approx(_flat_ring_crossover(p, 2, ab), rel=1e-9)


def test_rule():
    s = shardc.load_strategy(TEXT, mesh="node(2) > gpu(4)")       # V* = 8 MB, prefetch 1: keep 3
    mb = 10**6
    assert bucket_bytes(s, [mb] + [mb] * 6) == 6 * mb // 3          # capped: 3 buckets remain
    assert bucket_bytes(s, [mb] + [mb] * 30) == 8 * mb              # V* itself
    assert bucket_bytes(s, [mb] + [mb] * 3) == 0                    # too few units to fuse
    assert bucket_bytes(s, [mb] + [9 * mb] * 6) == 0                # no unit below V*
    s0 = dataclasses.replace(s, prefetch=0)
    assert bucket_bytes(s0, [mb] + [mb] * 3) == 2 * mb                   # [2, 1]: 2 buckets remain
    # 4 units of 3 MB, keep 3: a size that merges two merges all four pairwise ([6, 6]): none
    assert bucket_bytes(s, [mb] + [3 * mb] * 4) == 0



def _model():
    torch.manual_seed(0)
    return GPT(dataclasses.replace(TINY, n_layer=6))


def test_emitted_module_shows_the_size():
    src, plan = compile_source(_model(), TEXT, capture="fx")
    size = 6 * BLOCK // 3                       # V* = 2 MB for 4 ranks; capped: 3 buckets
    assert plan.strategy.bucket == size
    assert [u.name for u in plan.units] == ["<root>", "transformer.h.0..1", "transformer.h.2..3",
                                            "transformer.h.4..5"]
    assert f"bucket {size:,} bytes  (chosen by the cost model" in src and f"bucket={size}," in src
    src0, plan0 = compile_source(_model(), TEXT + "bucket 0\n", capture="fx")
    assert plan0.strategy.bucket == 0 and len(plan0.units) == 7
    assert "bucket 0 (no units merged)  (<string>:6;" in src0


def _job(rank, world):
    sm = shardc.compile(_model(), TEXT, capture="fx")
    assert len(sm.plan.units) == 4
    opt = sm.optimizer(torch.optim.AdamW, lr=1e-3)
    losses = train(sm, opt, batches(world, 2), rank, world, 2)
    with torch.no_grad():
        losses.append(eval_loss(sm, rank, world))
    return losses


@pytest.mark.distributed
def test_auto_bucketed_parity():
    results = dist_run(4, _job)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = train(model, opt, batches(4, 2), 0, 0, 2)
    with torch.no_grad():
        ref.append(eval_loss(model, 0, 4, split=False))
    mean = torch.tensor([r for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref), rtol=1e-5, atol=1e-6)
