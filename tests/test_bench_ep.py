"""The expert-parallel systems' names and FSDP2's predicted bytes in torchtitan's layout
(bench/peers/ep_systems.py [Note: +ep systems], bench/peers/ledgers.py `fsdp2_ep_ledger`), and the `moe`
preset (bench/models.py [Note: the moe preset]). No process group: one process, well under
a second."""
from __future__ import annotations

import pytest

from tests.bench_modules import load_bench


def test_ep_suffixes_parse():
    load_bench("peers/ep_systems")                                    # puts bench/ on sys.path
    from peers.systems import SystemName as Name, parse_system as parse
    assert parse("fsdp2+ep2") == parse("fsdp2:full+ep2") == Name("fsdp2:full", ep="2")
    assert parse("fsdp2+ep") == parse("fsdp2+epgpu") == Name("fsdp2:full", ep="gpu")
    assert parse("shardc:moe/ep2_zero3+ep2") == Name("shardc:moe/ep2_zero3", ep="2")
    assert load_bench("peers/ep_systems").ep_degree("gpu", 4) == 4
    for bad, why in [("fsdp2:hsdp+ep2", "fsdp2:full or shardc"), ("ddp+ep2", "fsdp2:full or shardc"),
                     ("shardc:zero3+ep2+tp", "without \\+tp"), ("fsdp2+ep2+compile", "without \\+tp"),
                     ("shardc:zero3+ep2+ep4", "twice"), ("fsdp2+ep0", "N >= 1")]:
        with pytest.raises(ValueError, match=why):
            parse(bad)


def test_fsdp2_ep_bytes_per_link():
    """node(2) > gpu(4), ep 2: dense units over the 8 ranks (a ring of 8: 2 of its edges
    cross nodes), experts over the 4 ranks ep leaves, node(2) > gpu(2) (2 of 4 edges cross);
    per step M forward and M backward all-gathers (not the root's backward) and one
    reduce-scatter, fp32."""
    report = load_bench("report")
    dense, experts, M = [100, 40, 40], [64, 64], 2
    res = {"ep": 2, "mesh": [["node", 2], ["gpu", 4]], "expert_mesh": [["node", 2], ["gpu", 2]],
           "unit_numels": dense, "expert_numels": experts}
    got = report.level_bytes("fsdp2+ep2", res, "moe", 2, 4, M)
    d = 4 * (M * sum(dense) + M * sum(dense[1:]) + sum(dense))
    e = 4 * (2 * M + 1) * sum(experts)
    assert got["node"] == pytest.approx(2 / 8 * 7 / 8 * d + 2 / 4 * 3 / 4 * e)
    assert got["gpu"] == pytest.approx(6 / 8 * 7 / 8 * d + 2 / 4 * 3 / 4 * e)


def test_the_moe_preset():
    models = load_bench("models")
    m = models.build_model("moe")
    assert models.model_dims(m) == (256, models.MOE_CONTEXT)
    assert models.n_params(m) == 3_478_656
    assert [len(b.moe.experts.w1) for b in models.block_modules(m)] == [8] * 4
    assert load_bench("peers/ep_systems").local_numels(m)[1] == [3 * 8 * 256 * 128] * 4
