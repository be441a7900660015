"""shardc against PaRO's and Lins' reported figures (docs/explain.md, "Validation against
the papers"; ZeRO-topo's are in test_paper_zero_topo.py). Expected values are the papers' numbers; each check states its tolerance.
Known misses are `xfail(strict=True)` with the reason, so they are visible, counted,
and flip to a failure the day the model starts matching them.

Settings the papers leave unstated are the ones docs/explain.md lists: Lins — per-GPU
links NVLink 200 GB/s (one link for both in-node levels) and an effective 6.5 GB/s
across nodes (calibrated on Lins' ZeRO-1 7B figure, `test_lins_calibration_zero1`),
achievable 200 TFLOP/s (Lins' 64 % MFU on 8 GPUs × A800's 312 TFLOP/s peak), 2 GiB
framework overhead; PaRO — intra-node 150 GB/s. The papers' DeepSpeed runs are written
as DeepSpeed issues its collectives: per submodule, over flat rings (tests/papers.py).
"""
from __future__ import annotations

import functools

import pytest

from shardc.dsl.ir import Collectives
from shardc.lowering import Op
from tests.papers import DEEPSPEED, strategy as _strategy

LINS_MESH = "node(128) > gpu(2) > lane(4)"      # lane(4) expresses Lins' s = 4 of 8 GPUs
# [Note: effective bandwidth at 128 nodes] Lins' nodes have 12.5 GB/s per GPU (4 HDR NICs
# per 8 GPUs), but Fig. 3 shows the effective bandwidth of ZeRO's collectives falling from
# 8 to 512 GPUs, with no numbers in the text. One figure calibrates it: DeepSpeed ZeRO-1 on
# 7B at 1024 GPUs, 36 % MFU (§I), which is not among the figures validated here. 6.5 GB/s
# (52 % of nominal) reproduces it; every other 1024-GPU figure is then a prediction.
LINS_NODE_BW = 6.5e9
# [Note: NVLink as two levels] `gpu` and `lane` split one NVLink per GPU into two mesh
# levels, so lane's traffic goes through gpu's links (`--link lane=gpu`, [Note: shared
# links] in analysis/costmodel/network.py): every in-node ring runs at 200 GB/s per GPU,
# whether it spans 4 or 8 GPUs. Given as two links, an 8-GPU ring would spread its bytes
# over both and run 4/3 as fast as a 4-GPU one (docs/explain.md, "NVLink as two levels").
LINS_LINKS = (("node", LINS_NODE_BW, None), ("gpu", 200e9, None))
LINS_SHARED = (("lane", "gpu"),)
CHECKPOINT = {"7b": False, "13b": False, "30b": True}   # Lins §VI-A: recomputation for 30B only
# Lins Table III, as (params, grads, optim) levels on LINS_MESH.
TABLE_III = {"7b": ((), (), ("gpu", "lane")), "13b": (("lane",), ("lane",), ("gpu", "lane")),
             "30b": (("gpu", "lane"),) * 3}
LINS_MFU = {"7b": 0.51, "13b": 0.52, "30b": 0.42}     # Lins §VI-B, 1024 GPUs
WORLD, NODE = ("node", "gpu", "lane"), ("gpu", "lane")


@functools.lru_cache(maxsize=None)
def _lins_model(size: str, tail: str = "", mesh: str = LINS_MESH):
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.analysis.costmodel.flops import trace
    from shardc.cli.loader import build_model
    from shardc.units import find_units
    base = _strategy(mesh, tail=tail)
    model = build_model(f"examples/llama.py:llama_{size}", device="meta")
    units = find_units(model, resolve_bucket(model, base))
    from shardc.analysis.costmodel.sizes import model_unit_sizes
    return model_unit_sizes(model, units), trace(model, units, batch=1, seq=4096, dtype="bf16")


def _links(node_bw: float = LINS_NODE_BW):
    from shardc.analysis.costmodel.network import LevelLinks
    from shardc.analysis.costmodel.timing import AlphaBeta
    return LevelLinks((("node", node_bw, None),) + LINS_LINKS[1:], AlphaBeta(), LINS_SHARED)


def _lins_explain(size: str, p, g, o, extra="", tail="", passes=None, mesh=LINS_MESH, node_bw=LINS_NODE_BW,
                  micro_batches=1):
    """One rank's prediction on `mesh`; the traced graph is per rank and micro-batch, so
    the one traced on LINS_MESH serves any mesh."""
    from dataclasses import replace
    from shardc.analysis.costmodel.report import explain
    s = _strategy(mesh, p, g, o, extra, tail)
    units, graph = _lins_model(size, tail)
    return explain(s, [replace(u, scopes=s.scopes) for u in units], micro_batches=micro_batches, bandwidth=_links(node_bw),
                   flops=200e12, graph=graph, checkpoint=CHECKPOINT[size], peak_flops=312e12, passes=passes)


@functools.lru_cache(maxsize=None)
def _lins_plan(size: str, objective: str, mesh: str = LINS_MESH, micro_batches: int = 1):
    """Lins' Table III pick among the fitting candidates ranked by `objective`: (its rank,
    its predicted step time over the best's, its summed communication over the least)."""
    from shardc.analysis.planner import plan
    from shardc.dsl.ir import DType
    units, graph = _lins_model(size, mesh=mesh)
    cands = plan(_strategy(mesh), units, 80 * 2**30, bandwidth=_links(), micro_batches=micro_batches,
                 dtype=DType.BF16, flops=200e12, graph=graph, checkpoint=CHECKPOINT[size], objective=objective)
    fit = [c for c in cands if c.fits]
    picks = [(c.scopes.params.levels, c.scopes.grads.levels, c.scopes.optim.levels) for c in fit]
    i = picks.index(TABLE_III[size])
    return (i + 1, fit[i].step_time / min(c.step_time for c in fit),
            fit[i].comm_time / min(c.comm_time for c in fit))


def test_paro_ho_ring_gain():
    # PaRO §4.2: all-gather over 2 DGX nodes; HO-Ring 309 ms vs ring 459 ms (−32.6 %). 8 GPUs
    # crossing at once share 56 GB/s (§3.3): 7 GB/s per GPU. Tolerance: 20 % of the gain.
    from shardc import load_strategy
    from shardc.analysis.costmodel.network import LevelLinks
    from shardc.analysis.costmodel.timing import AlphaBeta
    mesh = load_strategy("strategy a\nmesh node(2) > gpu(8)\n").mesh
    bw = LevelLinks((("node", 7e9, None), ("gpu", 150e9, None)), AlphaBeta())
    ring, ho = (bw.seconds(Op.ALL_GATHER, ("node", "gpu"), 100e9, mesh, a)
                for a in (Collectives.RING, Collectives.HO_RING))
    assert 1 - ho / ring == pytest.approx(1 - 309 / 459, rel=0.20)


def test_lins_calibration_zero1():
    # [Note: effective bandwidth at 128 nodes]: the one figure the node bandwidth is fitted
    # to. DeepSpeed ZeRO-1 modelled as one all-reduce of the gradients after the backward
    # and an all-gather of the parameters after the step: no plan passes, nothing overlaps.
    # Lins §I: 36 % MFU on 7B at 1024 GPUs. (Lins §VI-A turns overlap on in every baseline,
    # but DeepSpeed ZeRO-1/2's overlapped reduction is one dist.reduce per owner's slice of
    # each bucket, which a ring model cannot express; calibrated with the reduction hidden
    # behind the backward instead, 36 % needs 3.26 GB/s, and Lins' picks then come out
    # 0.76 / 0.76 / 0.90 of the paper and ZeRO-3 7B 0.77: worse on every row.)
    assert _baseline("zero1", "7b").rates["mfu"] == pytest.approx(0.36, rel=0.02)


@pytest.mark.parametrize("size", ["7b", "13b", "30b"])
def test_lins_mfu_of_its_strategy(size):
    e = _lins_explain(size, *TABLE_III[size])
    assert e.rates["mfu"] == pytest.approx(LINS_MFU[size], rel=0.20)
    assert e.peak["peak"] <= 80 * 2**30


MISS_SCALE = ("known miss by a hair (1.2025x): latency-bound over 1024 ranks, where the 20 us per ring step is "
              "a default and the synchronization skew of 1023-step rings is not modeled")
MISS_30B = ("known miss (2.22x): Lins gives no breakdown; DeepSpeed before 0.13.2 gathered a "
            "recomputation over the world, not from hpZ's secondary (PR #4906), which with non-reentrant "
            "checkpointing makes ZeRO++ send what ZeRO-3 sends: 1.49x, still outside")
# (strategy, size, Lins' MFU, extra params text): Lins §VI-B and §I at 1024 GPUs.
BASELINES = [
    pytest.param("mics", "7b", 0.35),
    pytest.param("mics", "13b", 0.33),
    pytest.param("mics", "30b", 0.29),
    pytest.param("zero3", "7b", 0.04),
    pytest.param("zero3", "13b", 0.04),
    pytest.param("zeropp", "7b", 0.04, marks=pytest.mark.xfail(strict=True, reason=MISS_SCALE)),
    pytest.param("zeropp", "13b", 0.06),
    pytest.param("zeropp", "30b", 0.05, marks=pytest.mark.xfail(strict=True, reason=MISS_30B)),
    pytest.param("zeropp_recompute_world", "30b", 0.05, marks=pytest.mark.xfail(strict=True, reason=MISS_30B)),
]


def _baseline(name: str, size: str, **at):
    """MiCS keeps shardc's per-block units: its in-node gathers cost a few microseconds
    either way, and per-block units come closer to DeepSpeed-MiCS' one flat cross-node
    all-reduce than per-submodule ones would. Its cross-node all-reduce is modelled after
    the backward (the plan without `early_sync`): DeepSpeed-MiCS issues it per reduce
    bucket on its reduction stream, and hidden behind the backward as `early_sync` hides
    a sync it would put MiCS at 1.6-1.8x Lins' MFU (docs/explain.md). ZeRO-1 as calibrated
    ([Note: effective bandwidth at 128 nodes]): nothing overlaps."""
    world = NODE if at.get("mesh") == LINS_NODE_MESH else WORLD     # on one node the world is the node
    if name == "zero1":
        return _lins_explain(size, (), (), world, passes=(), **at)
    if name == "mics":
        return _lins_explain(size, NODE, NODE, NODE, tail="collectives ring\n", passes=("defer_update",), **at)
    if name == "zeropp_recompute_world":
        # DeepSpeed < 0.13.2 with non-reentrant checkpointing: the recomputation's gathers
        # go over the world (hpZ only for gathers made with autograd off), so what ZeRO++
        # sends across nodes is ZeRO-3's (docs/explain.md, "Recomputation under ZeRO++").
        return _lins_explain(size, world, world, world, "", DEEPSPEED, **at)
    if name == "lins":
        return _lins_explain(size, *TABLE_III[size], **at)
    extra = " secondary gpu, lane" if name == "zeropp" else ""   # Lins: ZeRO++ s_p^0 = 8, no quantization
    return _lins_explain(size, world, world, world, extra, DEEPSPEED, **at)


@pytest.mark.parametrize("name, size, mfu", BASELINES)
def test_lins_mfu_of_deepspeed_baselines(name, size, mfu):
    # Tolerance 20 % of Lins' MFU, as for its own strategy.
    assert _baseline(name, size).rates["mfu"] == pytest.approx(mfu, rel=0.20)


# [Note: 30B on 32 GPUs] Lins §VI-B: "when training LLaMA-30B on 32 GPUs, ZeRO++
# encountered an OOM situation, whereas other methods achieved an MFU of around 40%" (Lins'
# own, MiCS, ZeRO-3; ZeRO-1's replicated bf16 parameters and gradients exceed 80 GiB). The
# effective node bandwidth at 32 GPUs is not given: Fig. 3 has it falling with scale, so
# it lies between the 1024-GPU 6.5 GB/s ([Note: effective bandwidth at 128 nodes]) and the
# nominal 12.5 GB/s, and both ends are checked. Tolerance 20 % of 40 %.
LINS_32 = "node(4) > gpu(2) > lane(4)"
MISS_32_OOM = ("known miss: Lins reports ZeRO++ out of memory on 30B at 32 GPUs; shardc predicts 31.7 GiB "
               "(22.6 GiB of model states with hpZ's secondary over 8 GPUs, 4.3 GiB of activations under "
               "per-layer recomputation); what DeepSpeed holds beyond that (its buckets, the prefetched and "
               "persistent parameters, fragmentation) is not modelled")


@pytest.mark.parametrize("node_bw", [LINS_NODE_BW, 12.5e9])
@pytest.mark.parametrize("name", ["lins", "mics", "zero3"])
def test_lins_30b_on_32_gpus_near_40pct_mfu(name, node_bw):
    assert _baseline(name, "30b", mesh=LINS_32, node_bw=node_bw).rates["mfu"] == pytest.approx(0.40, rel=0.20)


@pytest.mark.xfail(strict=True, reason=MISS_32_OOM)
def test_lins_zeropp_30b_on_32_gpus_is_out_of_memory():
    # Memory with DeepSpeed's recomputation, per decoder layer (shardc's per-block units),
    # not per submodule as `_baseline`'s DeepSpeed units would checkpoint.
    e = _lins_explain("30b", WORLD, WORLD, WORLD, " secondary gpu, lane", mesh=LINS_32)
    assert e.peak["peak"] > 80 * 2**30


MISS_III_COMM = ("known miss (1.07x, 1.08x the least): with NCCL's multi-channel rings spread over all NICs, "
                 "sharding the optimizer over the world is cheaper than Lins' in-node choice")
MISS_III_TIME = ("disagrees on purpose (7B 6.0 %, 13B 1.6 %, 30B 1.1 % behind the best): shardc's runtime "
                 "issues a sync all-reduce that follows a reduce-scatter one unit late and the last two at "
                 "opt.step(), so sharding the gradients over the node hides more of the same bytes")


@pytest.mark.parametrize("size", ["7b", pytest.param("13b", marks=pytest.mark.xfail(strict=True, reason=MISS_III_COMM)),
                                  pytest.param("30b", marks=pytest.mark.xfail(strict=True, reason=MISS_III_COMM))])
def test_lins_table_iii_pick_has_the_least_communication(size):
    # Lins' objective (§IV-C): the least summed communication under the memory limit. For
    # 7B Lins' pick ties with 7 other layouts that send the same bytes per link level.
    assert _lins_plan(size, "comm")[2] == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("size", [pytest.param(z, marks=pytest.mark.xfail(strict=True, reason=MISS_III_TIME))
                                  for z in ("7b", "13b", "30b")])
def test_lins_table_iii_pick_is_within_1pct_of_the_best_step(size):
    # By predicted step time the candidates near the top lie within a few per cent of each
    # other, below run-to-run spread: the check is that Lins' pick is the best to within 1 %.
    assert _lins_plan(size, "time")[1] <= 1.01


# [Note: Table III at 8 GPUs] Lins "maintains a uniform set of configurations when scaling
# training from 8 GPUs to 1024 GPUs" (§VI-A): one layout per model, valid on one node. So
# Table III is also checked where that layout must already be the solver's answer: 8 GPUs,
# the same 4M-token batch as 128 micro-batches of one sequence (§VI-A: M = 128). There,
# sharding the parameters or gradients costs a collective per micro-batch, so memory decides.
LINS_NODE_MESH, LINS_NODE_M = "gpu(2) > lane(4)", 128
MISS_III_NODE_13B = ("disagrees on purpose (2nd of 4 that fit, 1.20x the least): Lins gives s_g > s_p an "
                     "all-reduce over s_g/s_p GPUs with select & drop (IV-C), under which params over 2 with "
                     "grads over 8 and its pick send the same bytes and its profiled bandwidths break the tie; "
                     "shardc reduce-scatters straight to the gradients' scope, which sends less "
                     "(test_lins_13b_one_node_bytes_per_micro_batch)")

# 30b: Lins' pick ranks first since explain's peak is the memory timeline (the backward's
# gradients and reduce workspace counted): params over 4 with grads over 8 no longer fits
# 80 GiB (80.5 GiB; Lins' pick, ZeRO-3 over the node, 72.9 GiB, is the one layout that fits),
# which is the condition the known miss named
@pytest.mark.parametrize("size", ["7b", pytest.param("13b", marks=pytest.mark.xfail(strict=True, reason=MISS_III_NODE_13B)),
                                  "30b"])
def test_lins_table_iii_pick_has_the_least_communication_on_one_node(size):
    assert _lins_plan(size, "comm", LINS_NODE_MESH, LINS_NODE_M)[0] == 1     # its rank


def test_lins_13b_one_node_bytes_per_micro_batch():
    # Per rank and micro-batch, bf16 (2 bytes per parameter), Φ parameters, Φ_r of them in
    # the root, which the backward does not re-gather. Lins' pick (params and grads over 4):
    # gather 3/4 of 2Φ forward and of 2(Φ - Φ_r) backward, reduce-scatter 3/4 of 2Φ. Params
    # over 2, grads over 8: gather 1/2 of each, reduce-scatter 7/8 of 2Φ straight to the
    # gradients' scope. (Lins' executor: reduce-scatter 1/2 of 2Φ, then all-reduce the
    # shard Φ over 4 GPUs, 2·3/4·Φ: 4.5Φ, as its pick sends when Φ_r = 0.)
    from dataclasses import replace
    from shardc.analysis.costmodel.report import explain
    units, graph = _lins_model("13b", mesh=LINS_NODE_MESH)
    phi, root = sum(u.trainable for u in units), units[0].trainable

    def per_micro_batch(p, g, o):
        s = _strategy(LINS_NODE_MESH, p, g, o)
        us = [replace(u, scopes=s.scopes) for u in units]
        total = [sum(explain(s, us, micro_batches=m, bandwidth=_links(), graph=graph).links.values())
                 for m in (1, 2)]
        return total[1] - total[0]

    pick = per_micro_batch(("lane",), ("lane",), NODE)
    other = per_micro_batch(("gpu",), NODE, NODE)
    assert pick == pytest.approx(3 / 4 * 2 * phi + 3 / 4 * 2 * (phi - root) + 3 / 4 * 2 * phi, rel=1e-6)
    assert other == pytest.approx(1 / 2 * 2 * phi + 1 / 2 * 2 * (phi - root) + 7 / 8 * 2 * phi, rel=1e-6)


@pytest.mark.parametrize("size", ["7b", "13b", "30b"])
def test_lins_table_iii_pick_is_within_1pct_of_the_best_step_on_one_node(size):
    assert _lins_plan(size, "time", LINS_NODE_MESH, LINS_NODE_M)[1] <= 1.01


# [Note: DeepSpeed on one node] Lins gives three DeepSpeed figures on 8 GPUs with the
# 1024-GPU batch (M = 128, "with the same batch size"): ZeRO-1 7B 63 % (§I), ZeRO-3 13B
# 47 % (§III-A), MiCS 7B 50 % (§III-C). Over NVLink, by shardc's count, every collective
# of the three hides behind 128 micro-batches of compute, so all three come out near
# Lins' own 64 % there (the figure the achievable rate is taken from); ZeRO-1, which Lins
# says sends what its own 7B layout sends, is the check. Tolerance 20 %, as at 1024.
MISS_NODE_DS = ("known miss (MiCS 1.23x, ZeRO-3 1.24x): by shardc's count their in-node collectives hide behind the "
                "compute, as Lins' and ZeRO-1's do; DeepSpeed's ZeRO-3 engine, which MiCS builds on, ran 14-17 "
                "points below Lins' 64 % on one node, and what it spends beyond its collectives there is not modelled")
ONE_NODE = [pytest.param("zero1", "7b", 0.63),
            pytest.param("mics", "7b", 0.50, marks=pytest.mark.xfail(strict=True, reason=MISS_NODE_DS)),
            pytest.param("zero3", "13b", 0.47, marks=pytest.mark.xfail(strict=True, reason=MISS_NODE_DS))]


@pytest.mark.parametrize("name, size, mfu", ONE_NODE)
def test_lins_mfu_of_deepspeed_on_one_node(name, size, mfu):
    e = _baseline(name, size, mesh=LINS_NODE_MESH, micro_batches=LINS_NODE_M)
    assert e.rates["mfu"] == pytest.approx(mfu, rel=0.20)
