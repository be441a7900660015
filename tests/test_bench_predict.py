"""bench/predict.py: predicted vs measured step time from a profile and a systems JSON.

The fixture (tests/golden/predict/) is hand-written: constant bandwidths per level set
(gpu 200 MB/s with every second on the cores, node 10 MB/s with 10 % on the cores,
node+gpu hierarchical 20 MB/s with 25 %; compute wall/CPU = 0.8/0.2 = 4, 1.25e10 FLOP/s
per rank), the bench model on node(2) > gpu(4), 4 micro-batches. The expected step
times are derived here from the ledger rules (docs/internals.md), [Note: step time] /
[Note: CPU share of a collective] (analysis/costmodel/profile.py) and [Note: sync
overlap] (pipeline.py), with the bench model's parameter counts and traced FLOPs as inputs.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.bench_modules import load_bench as _bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "golden", "predict")


def _inputs():
    """Φ (parameters), executed FLOPs of one micro-batch (2 sequences of 64) of the bench
    model, its units' parameters and forward FLOPs (root first)."""
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.analysis.costmodel.flops import trace
    from shardc.cli.loader import build_model
    from shardc.dsl import load_strategy
    from shardc.units import find_units

    models = _bench("models")
    phi = models.n_params(models.build_model("bench"))
    meta = build_model(os.path.join(ROOT, "bench", "models.py") + ":bench", device="meta")
    one = load_strategy("mesh gpu(1)\nparams replicate\n")
    units = find_units(meta, resolve_bucket(meta, one))
    from shardc.analysis.costmodel.sizes import model_unit_sizes
    sizes = [u.trainable for u in model_unit_sizes(meta, units)]
    graph = trace(meta, units, batch=2, seq=64, dtype="fp32")
    return phi, graph.executed_flops(), sizes, graph.unit_forward_flops


def _sync_exposed(waits, shares, backward):
    """[Note: sync overlap] by hand, root first in `waits`/`shares`: the root's compute
    opens the backward, then blocks n..1; sync i goes out when the next unit's gradients
    are in (the root's at the end), one at a time; what runs past the backward shows."""
    order = list(range(len(waits) - 1, 0, -1)) + [0]
    t, ready = backward * shares[0], []
    for i in order[:-1]:
        t += backward * shares[i]
        ready.append(t)
    issue, link = ready[1:] + [backward, backward], 0.0
    for i, at in zip(order, issue):
        link = max(at, link) + waits[i]
    return max(0.0, link - backward)


def _expected(phi, flops, sizes, unit_flops):
    m, c = 4, flops / 1.25e10                        # micro-batches, compute per micro-batch
    shares = [f / sum(unit_flops) for f in unit_flops]
    d = sum(1 for n in sizes if n)                    # units with an update all-gather
    # hsdp_zero2: backward reduce-scatter of 4Φ over gpu per micro-batch (all on the cores),
    # sync all-reduce of each unit's gpu shard (4n/4 bytes) over node (10 % on the cores),
    # update all-gather of 4Φ over gpu (all on the cores).
    rs_b, ag_u = 4 * phi / 200e6, 4 * phi / 200e6
    ar = [n / 10e6 for n in sizes]
    hsdp = m * c + m * rs_b + 0.1 * sum(ar) + _sync_exposed([0.9 * t for t in ar], shares, 2 / 3 * c) + ag_u
    # zero1 (hierarchical): sync reduce-scatter of each unit's 4n over the world (25 % on the
    # cores), update all-gather of 4Φ over it, deferred into the next forward over d units
    # ([Note: deferred update overlap]): its link waits hide behind a third of a micro-batch,
    # all but the first unit's share.
    rs = [4 * n / 20e6 for n in sizes]
    ag_u = 4 * phi / 20e6
    zero1 = (m * c + 0.25 * sum(rs) + _sync_exposed([0.75 * t for t in rs], shares, 2 / 3 * c)
             + 0.25 * ag_u + max(0.75 * ag_u / d, 0.75 * ag_u - c / 3))
    return {"shardc:hsdp_zero2": hsdp, "shardc:zero1": zero1}


def test_predicted_vs_measured_table(tmp_path):
    predict = _bench("predict")
    want = _expected(*_inputs())
    with open(os.path.join(FIX, "systems.json")) as f:
        doc = json.load(f)
    rows = predict.table(os.path.join(FIX, "profile.json"), doc)
    # the peers and the failed system are not predicted; rows in measured order
    assert [r["system"] for r in rows] == ["shardc:hsdp_zero2", "shardc:zero1"]
    measured = {"shardc:hsdp_zero2": 6.0, "shardc:zero1": 9.0}
    for r in rows:
        assert r["predicted_s"] == pytest.approx(want[r["system"]], rel=1e-6)
        assert r["time"]["compute"] == pytest.approx(4 * _inputs()[1] / 1.25e10, rel=1e-9)
        assert r["ratio"] == pytest.approx(want[r["system"]] / measured[r["system"]], rel=1e-6)
        assert r["within"] == (abs(want[r["system"]] / measured[r["system"]] - 1) <= 0.15)
    order = sorted(want, key=want.get)
    assert [r["predicted_rank"] for r in rows] == [order.index(r["system"]) + 1 for r in rows]
    assert [r["measured_rank"] for r in rows] == [1, 2]
    assert predict.top_order_matches(rows) == (order == ["shardc:hsdp_zero2", "shardc:zero1"])


def test_cli_writes_the_markdown_table(tmp_path, capsys):
    predict = _bench("predict")
    md = tmp_path / "t.md"
    assert predict.main([os.path.join(FIX, "profile.json"), os.path.join(FIX, "systems.json"),
                         "--md", str(md)]) == 0
    text = md.read_text()
    assert text.splitlines()[0].startswith("| strategy | collectives | predicted (s)")
    assert "| hsdp_zero2 | ring |" in text and "| zero1 | hierarchical |" in text
    assert "of 2 within 15%" in text and text in capsys.readouterr().out + "\n"
    # all three of hsdp_zero2's steps are shorter than all of zero1's: U = 9 of 9
    assert "Measured order of the top three resolved at 5 %" in text and "hsdp_zero2 < zero1 p = 0.0248" in text
    # the failed shardc system is named, not dropped silently; the peer (not shardc) is not
    assert text.count("Left out:") == 1 and "Left out: shardc:zero3: not predicted, its run failed (" in text


def test_order_p_is_the_one_sided_mann_whitney_u_test():
    # By hand, normal approximation: n1 = n2 = 3, mean U = 4.5, sd = sqrt(9 * 7 / 12) = 2.2913.
    # All of a below all of b: U = 9, z = 1.9640, p = 1 - Phi(1.9640) = 0.02477.
    predict = _bench("predict")
    assert predict.order_p([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == pytest.approx(0.02477, abs=1e-4)
    # interleaved (1 < 2, 1 < 4, 1 < 6, 3 < 4, 3 < 6, 5 < 6): U = 6, z = 0.6547, p = 0.2563
    assert predict.order_p([1.0, 3.0, 5.0], [2.0, 4.0, 6.0]) == pytest.approx(0.2563, abs=1e-4)
    # the wrong way round: U = 0, p = 1 - 0.02477
    assert predict.order_p([4.0, 5.0, 6.0], [1.0, 2.0, 3.0]) == pytest.approx(0.97523, abs=1e-4)


def test_measured_order_names_each_unresolved_pair():
    predict = _bench("predict")
    rows = [{"system": "shardc:a", "measured_rank": 1, "step_times": [1.0, 2.0, 3.0]},
            {"system": "shardc:b", "measured_rank": 2, "step_times": [4.0, 5.0, 6.0]},
            {"system": "shardc:c", "measured_rank": 3, "step_times": [4.5, 5.5, 5.0]},
            {"system": "shardc:d", "measured_rank": 4, "step_times": [9.0, 9.0, 9.0]}]
    ok, line = predict.measured_order(rows)
    assert not ok
    assert line.startswith("a < b p = 0.0248;") and line.endswith("(not resolved)")
    assert line.count(";") == 1 and "c < d" not in line          # the top three only: two pairs


def _fixture_and_a_second_run() -> tuple[dict, dict]:
    """The fixture's systems JSON, and a copy holding its measured shardc systems only."""
    with open(os.path.join(FIX, "systems.json")) as f:
        doc = json.load(f)
    other = json.loads(json.dumps(doc))
    other["systems"] = {k: v for k, v in other["systems"].items() if k.startswith("shardc:") and "error" not in v}
    return doc, other


def test_several_systems_json_pool_their_steps(tmp_path):
    # The fixture twice, the second with other step times: each system's steps are pooled
    # (six each), `measured` is the median of the six, and the order line counts 6 steps.
    predict = _bench("predict")
    doc, other = _fixture_and_a_second_run()
    other["systems"]["shardc:hsdp_zero2"].update(step_times=[6.4, 6.6, 6.8], step_time_s=6.6)
    other["systems"]["shardc:zero1"].update(step_times=[8.0, 8.1, 8.2], step_time_s=8.1)
    second = tmp_path / "second.json"
    second.write_text(json.dumps(other))
    rows = {r["system"]: r for r in predict.table(os.path.join(FIX, "profile.json"),
                                                  predict.pool([doc, json.loads(second.read_text())]))}
    assert rows["shardc:hsdp_zero2"]["measured_s"] == pytest.approx((6.2 + 6.4) / 2)
    assert rows["shardc:zero1"]["measured_s"] == pytest.approx((8.2 + 8.7) / 2)
    assert sorted(rows["shardc:zero1"]["step_times"]) == [8.0, 8.1, 8.2, 8.7, 9.0, 9.4]
    md = tmp_path / "t.md"
    assert predict.main([os.path.join(FIX, "profile.json"), os.path.join(FIX, "systems.json"), str(second),
                         "--md", str(md)]) == 0
    assert "over 6 steps each" in md.read_text()


def test_a_failed_run_in_one_file_leaves_the_others_pooled(tmp_path):
    # zero1 failed in a second run (as a teardown abort once did): its three good steps
    # stay in the table, and a line says one of its two runs was left out.
    predict = _bench("predict")
    doc, other = _fixture_and_a_second_run()
    other["systems"]["shardc:zero1"] = {"error": "torchrun exited with [1, 1] (see log_tail)"}
    pooled = predict.pool([doc, other])
    rows = {r["system"]: r for r in predict.table(os.path.join(FIX, "profile.json"), pooled)}
    assert sorted(rows["shardc:zero1"]["step_times"]) == sorted(doc["systems"]["shardc:zero1"]["step_times"])
    assert sorted(rows["shardc:hsdp_zero2"]["step_times"]) == sorted(doc["systems"]["shardc:hsdp_zero2"]["step_times"] * 2)
    lines = predict.left_out(pooled)
    assert len(lines) == 2 and lines[0].startswith("shardc:zero3: not predicted")
    assert lines[1] == ("shardc:zero1: 1 of its 2 runs failed (torchrun exited with [1, 1] (see log_tail)); "
                        "its other runs are pooled")


def test_pooling_refuses_runs_of_another_setting():
    predict = _bench("predict")
    with open(os.path.join(FIX, "systems.json")) as f:
        doc = json.load(f)
    other = json.loads(json.dumps(doc))
    other["config"]["inter_rate"] = "1gbit"
    with pytest.raises(SystemExit, match="differ in inter_rate"):
        predict.pool([doc, other])
