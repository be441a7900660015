"""shardc against ZeRO-topo's reported figures (docs/explain.md, "Validation against the
papers"): the largest model sizes on 16 GCDs and the throughput ratios on 384 GCDs of
Frontier. Expected values are the paper's numbers; each check states its tolerance.

Settings the paper leaves unstated are the ones docs/explain.md lists: per-GCD links node
12.5, gpu 50, gcd 200 GB/s and 15 us per inter-node ring step (fitted, [Note: ring latency
on Frontier]). The baselines are written as DeepSpeed issues its collectives: per
submodule, over flat rings (tests/papers.py).
"""
from __future__ import annotations

import functools
import math

import pytest

from tests.papers import DEEPSPEED, strategy as _strategy


def test_zero_topo_max_model_sizes():
    # ZeRO-topo §I: 16 GCDs (2 Frontier nodes), 64 GiB each, mixed precision + Adam, model
    # states only: ZeRO-3 ≈ 68B, ZeRO++ ≈ 55B (DeepSpeed's bytes, scaled below); §VII:
    # ZeRO-topo ≈ 36B. Tolerance 5 % / 15 %.
    from shardc.analysis.costmodel.memory import predict_memory
    from shardc.cli.loader import load_model_units
    mesh = "node(2) > gpu(4) > gcd(2)"
    cases = {"zero3": (("node", "gpu", "gcd"),) * 3,
             "zeropp": (("node", "gpu", "gcd"), ("node", "gpu", "gcd"), ("node", "gpu", "gcd"))}
    s = _strategy(mesh, *cases["zero3"])
    units = load_model_units(s, "examples/llama.py:llama_7b")   # small root: hpZ keeps no root secondary
    phi = sum(u.trainable for u in units)

    def max_params(strategy):
        from dataclasses import replace
        per = predict_memory(strategy.mesh, [replace(u, scopes=strategy.scopes) for u in units])["total"] / phi
        return 64 * 2**30 / per

    # DeepSpeed keeps a bf16 params shard beside the fp32 master (2 + 2 + 12 bytes a parameter,
    # over 16 GCDs); where params and optimizer states shard over the same levels shardc keeps
    # the master as the params shard (4 + 2 + 8, FSDP2's layout: shardc.lowering [Note: the
    # master is the params shard]), so the paper's figures scale by its bytes over shardc's
    assert max_params(s) == pytest.approx(68e9 * 16 / 14, rel=0.05)
    # ZeRO++: hpZ's bf16 secondary over 8 GCDs beside the states, 2/8 bytes a parameter
    zeropp = (16 / 16 + 2 / 8) / (14 / 16 + 2 / 8)
    assert max_params(_strategy(mesh, *cases["zeropp"], extra=" secondary gpu, gcd")) == pytest.approx(
        55e9 * zeropp, rel=0.05)
    topo = _strategy(mesh, ("gcd",), ("gpu", "gcd"), ("node", "gpu", "gcd"), extra=" secondary gpu, gcd int8")
    assert max_params(topo) == pytest.approx(36e9, rel=0.15)


# ZeRO-topo §VI on Frontier: GPT-NeoX-20B on 384 GCDs; per-GCD links node 12.5 GB/s
# (100 GB/s per node / 8), gpu 50 GB/s, gcd 200 GB/s; 2048 tokens per micro-batch, 16
# micro-batches, 80 of 191.5 TFLOP/s achievable. All three run on DeepSpeed over RCCL:
# per-submodule collectives over flat rings (DEEPSPEED).
# [Note: ring latency on Frontier] ZeRO-3's and ZeRO++'s steps here are latency-bound
# (each of their per-submodule collectives is a 383-step ring over the 384 GCDs), and the
# paper states no RCCL latency. One parameter, the latency per inter-node ring step, is
# fitted to the paper's three throughput ratios (least squares in log ratio, to the
# nearest microsecond): 15 us. Residuals at 15 us: -0.2 %, +2.7 %, -3.3 %; at 14 and 16 us
# the sum of squares is 3x and 4x larger; at the 20 us default two ratios miss by 25 %.
# With one parameter for three figures, two are checks of the model's structure.
TOPO_RING_STEP = 15e-6
TOPO_MESH = "node(48) > gpu(4) > gcd(2)"
TOPO_LINKS = (("node", 12.5e9, TOPO_RING_STEP), ("gpu", 50e9, None), ("gcd", 200e9, None))
TOPO = {"zero3": ("shard over world", "", "shard over world"),
        "zeropp": ("shard over world", " secondary gpu, gcd int8 comm int8", "shard over world comm int4"),
        "zero_topo": ("shard over gcd", " secondary gpu, gcd int8 comm int8", "shard over gpu, gcd comm int4")}


@functools.lru_cache(maxsize=None)
def _topo_units(name: str):
    """The strategy, its per-submodule unit sizes and the traced graph (meta device)."""
    from shardc import load_strategy
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.analysis.costmodel.flops import trace
    from shardc.analysis.costmodel.sizes import model_unit_sizes
    from shardc.cli.loader import build_model
    from shardc.units import find_units
    p, opts, g = TOPO[name]
    s = load_strategy(f"strategy {name}\nmesh {TOPO_MESH}\nparams {p}{opts} dtype bf16\n"
                      f"grads {g} dtype bf16\noptim shard over world\naccumulate 16\n{DEEPSPEED}")
    model = build_model("examples/gpt_neox.py:neox_20b", device="meta")
    units = find_units(model, resolve_bucket(model, s))
    return s, model_unit_sizes(model, units), trace(model, units, batch=1, seq=2048, dtype="bf16")


@functools.lru_cache(maxsize=None)
def _topo_seconds(name: str, links=TOPO_LINKS) -> float:
    from shardc.analysis.costmodel.network import LevelLinks
    from shardc.analysis.costmodel.report import explain
    from shardc.analysis.costmodel.timing import AlphaBeta
    s, units, graph = _topo_units(name)
    e = explain(s, units, bandwidth=LevelLinks(links, AlphaBeta()), flops=80e12, graph=graph, peak_flops=191.5e12)
    return e.time.total


TOPO_RATIOS = [("zero_topo", "zero3", 2.40), ("zero_topo", "zeropp", 1.71), ("zeropp", "zero3", 1.41)]


@pytest.mark.parametrize("fast, slow, paper", TOPO_RATIOS)
def test_zero_topo_throughput_ratios(fast, slow, paper):
    # ZeRO-topo §VI: +139.8 % and +70.7 % TFLOPS per GPU over ZeRO-3 and ZeRO++, ZeRO++ +40.5 %
    # over ZeRO-3, 384 GCDs, 20B. Tolerance 20 % of the ratio, as for the MFU figures.
    assert _topo_seconds(slow) / _topo_seconds(fast) == pytest.approx(paper, rel=0.20)


def test_zero_topo_ring_latency_is_the_least_squares_fit():
    # [Note: ring latency on Frontier]: the fitted latency is the best to the microsecond,
    # and even at the fit the ratios stay within 4 % (one parameter cannot bend three).
    def sq(step):
        links = tuple((l, w, step if l == "node" else a) for l, w, a in TOPO_LINKS)
        return sum(math.log(_topo_seconds(s, links) / _topo_seconds(f, links) / p) ** 2 for f, s, p in TOPO_RATIOS)
    fit = sq(TOPO_RING_STEP)
    assert fit < sq(TOPO_RING_STEP - 1e-6) and fit < sq(TOPO_RING_STEP + 1e-6)
    assert all(abs(math.log(_topo_seconds(s) / _topo_seconds(f) / p)) < math.log(1.04) for f, s, p in TOPO_RATIOS)
