"""Predictions at scale: per-level links and the collective models, FLOPs and activations
from the traced meta graph, the peak memory the planner binds on, MFU and tokens/s, and
the planner's explicit objective. Expected figures come from the formulas in
analysis/costmodel/{network,flops,activations}.py's notes, computed by hand here.
"""
from __future__ import annotations

import json

import pytest

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Collectives
from shardc.lowering import Op
from tests.test_plan import run_cmd

TINY = "examples/llama.py:llama_tiny"


def _links(*spec):
    from shardc.analysis.costmodel.network import parse_links
    from shardc.analysis.costmodel.timing import AlphaBeta
    return parse_links(spec, AlphaBeta())


def test_three_level_links_and_algorithms():
    from shardc import load_strategy
    mesh = load_strategy("strategy a\nmesh node(2) > gpu(2) > gcd(2)\n").mesh
    bw = _links("node=25GB/s@20us", "gpu=200GB/s@5us", "gcd=50GB/s@1us")
    v, lv = 8e9, ("node", "gpu", "gcd")
    # flat ring over 8: 7 steps at the slowest latency; per rank, node links carry 2/8·7/8·V,
    # gpu links 2/8·7/8·V, gcd links 4/8·7/8·V (links.flat_ring's edge counts), all at once.
    wire = max(2 / 8 * 7 / 8 * v / 25e9, 2 / 8 * 7 / 8 * v / 200e9, 4 / 8 * 7 / 8 * v / 50e9)
    assert bw.seconds(Op.ALL_GATHER, lv, v, mesh, Collectives.RING) == pytest.approx(7 * 20e-6 + wire)
    # hierarchical: one stage per level on V / (inner sizes), one after the other.
    gcd, gpu, node = (1e-6 + v / 2 / 50e9), (5e-6 + v / 2 / 2 / 200e9), (20e-6 + v / 4 / 2 / 25e9)
    assert bw.seconds(Op.ALL_GATHER, lv, v, mesh, Collectives.HIERARCHICAL) == pytest.approx(gcd + gpu + node)
    with pytest.raises(ShardcError, match="LEVEL=BANDWIDTH"):
        _links("node:25GB/s")
    with pytest.raises(ShardcError, match="not on the mesh"):
        _links("rack=25GB/s").check(mesh)


def test_ho_ring_against_flat_ring_on_paro_setting():
    # PaRO §4.2: 2 nodes of 8, 8 GPUs crossing at once share 56 GB/s (7 GB/s each).
    from shardc import load_strategy
    mesh = load_strategy("strategy a\nmesh node(2) > gpu(8)\n").mesh
    bw = _links("node=7GB/s@20us", "gpu=150GB/s@5us")
    v, lv = 100e9, ("node", "gpu")
    ring = 15 * 20e-6 + max(2 / 16 * 15 / 16 * v / 7e9, 14 / 16 * 15 / 16 * v / 150e9)
    inter, intra = 1 * (4 * 20e-6 + v / 8 / 2 / 7e9), 7 * (4 * 5e-6 + v / 8 / 150e9)
    assert bw.seconds(Op.ALL_GATHER, lv, v, mesh, Collectives.RING) == pytest.approx(ring)
    assert bw.seconds(Op.ALL_GATHER, lv, v, mesh, Collectives.HO_RING) == pytest.approx(max(inter, intra) + min(inter, intra) / 4)


def test_levels_on_one_link():
    # [Note: shared links]: gpu(2) > lane(4) is one 8-GPU node; `lane=gpu` puts lane's
    # traffic on gpu's links, so a flat ring over the node is one ring of 8 on one link.
    from shardc import load_strategy
    mesh = load_strategy("strategy a\nmesh node(2) > gpu(2) > lane(4)\n").mesh
    apart = _links("node=25GB/s@20us", "gpu=200GB/s@5us", "lane=200GB/s@5us")
    one = _links("node=25GB/s@20us", "gpu=200GB/s@5us", "lane=gpu")
    v = 8e9
    ring8 = 7 * 5e-6 + 7 / 8 * v / 200e9
    assert one.seconds(Op.ALL_GATHER, ("gpu", "lane"), v, mesh, Collectives.RING) == pytest.approx(ring8)
    # apart, the ring's bytes split 2:6 over the two links (links.flat_ring's edge counts)
    assert apart.seconds(Op.ALL_GATHER, ("gpu", "lane"), v, mesh, Collectives.RING) == pytest.approx(
        7 * 5e-6 + 6 / 8 * 7 / 8 * v / 200e9)
    assert one.seconds(Op.ALL_GATHER, ("lane",), v, mesh, Collectives.RING) == pytest.approx(3 * 5e-6 + 3 / 4 * v / 200e9)
    # ho-ring: gpu's and lane's stages run one after the other on their one link
    node = 4 * 20e-6 + v / 8 / 2 / 25e9
    gpu, lane = 4 * 5e-6 + v / 4 / 2 / 200e9, 3 * (4 * 5e-6 + v / 4 / 200e9)
    inside = gpu + lane
    lv = ("node", "gpu", "lane")
    assert one.seconds(Op.ALL_GATHER, lv, v, mesh, Collectives.HO_RING) == pytest.approx(
        max(node, inside) + min(node, inside) / 4)
    assert str(one).startswith("per-level links: node 25 GB/s + 20 us, gpu 200 GB/s + 5 us, lane on gpu's links")
    with pytest.raises(ShardcError, match="'lane' must be a level with links of its own"):
        _links("gpu=lane", "lane=gpu").check(mesh)
    with pytest.raises(ShardcError, match="not on the mesh"):
        _links("lane=rack").check(mesh)
    with pytest.raises(ShardcError, match="twice"):
        _links("lane=gpu", "lane=200GB/s")


def test_explain_with_a_level_on_another_levels_links(tmp_path, capsys):
    # Real strategy text through explain: a node split as gpu(2) > lane(4) with lane on
    # gpu's links predicts what the same node as one level gpu(8) predicts.
    def explain(mesh, scope, *links):
        f = tmp_path / f"{scope.replace(', ', '_')}.shard"
        f.write_text(f"strategy s\nmesh {mesh}\nparams shard over {scope}\ngrads shard over {scope}\n"
                     f"optim shard over {scope}\ncollectives ring\n")
        assert run_cmd("explain", [str(f), "--model", TINY, "--tokens", "16", "--seq", "8", "--tflops", "1e-3",
                                   "--link", "gpu=20GB/s@5us", *links, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["time"]
    one = explain("gpu(8)", "gpu")
    split = explain("gpu(2) > lane(4)", "gpu, lane", "--link", "lane=gpu")
    apart = explain("gpu(2) > lane(4)", "gpu, lane", "--link", "lane=20GB/s@5us")
    assert split["total"] == pytest.approx(one["total"], rel=1e-9)
    assert apart["total"] < split["total"]          # two links carry the ring faster


def test_the_step_replays_levels_on_one_link_as_one():
    # pipeline.py queues every collective on the link it goes through: with lane=gpu no
    # collective waits on a `lane` link of its own.
    from shardc import load_strategy
    from shardc.analysis.costmodel.pipeline import waits_of
    from shardc.analysis.costmodel.timing import phase_costs
    from shardc.lowering import UnitSize, lower
    s = load_strategy("strategy a\nmesh node(2) > gpu(2) > lane(4)\nparams shard over lane\n"
                      "grads shard over gpu, lane\noptim shard over gpu, lane\n")
    units = [UnitSize(f"u{i}", 1000, 0, s.scopes, root=i == 0) for i in range(3)]
    plan = lower(s.mesh, units, 1)
    parts = lambda bw: {k for w in waits_of(plan, s.mesh, bw, Collectives.RING, phase_costs)[:3] for p in w for k in p}
    assert parts(_links("node=25GB/s", "gpu=200GB/s", "lane=200GB/s")) == {"gpu", "lane"}
    assert parts(_links("node=25GB/s", "gpu=200GB/s", "lane=gpu")) == {"gpu"}
    from shardc.analysis.costmodel.timing import AlphaBeta
    assert parts(AlphaBeta()) == {"gpu"}                  # [Note: one in-node link]


def test_the_two_tier_default_has_one_in_node_link():
    # [Note: one in-node link] in timing.py: --intra/--inter alone put every inner level on
    # one link at `intra`; with `--link`, inner levels it does not name use the first
    # inner level's link.
    from shardc import load_strategy
    from shardc.analysis.costmodel.timing import AlphaBeta
    mesh = load_strategy("strategy a\nmesh node(2) > gpu(2) > lane(4)\n").mesh
    v, intra = 8e9, 100e9
    ring8 = 7 * 5e-6 + 7 / 8 * v / intra
    for bw in (AlphaBeta(), _links("node=25GB/s")):
        assert bw.seconds(Op.ALL_GATHER, ("gpu", "lane"), v, mesh, Collectives.RING) == pytest.approx(ring8)
        assert bw.seconds(Op.ALL_GATHER, ("lane",), v, mesh, Collectives.RING) == pytest.approx(3 * 5e-6 + 3 / 4 * v / intra)
    # ho-ring on the default: the node stage at `inter`, gpu's and lane's stages in turn on one link
    node = 4 * 20e-6 + v / 8 / 2 / 12.5e9
    inside = 4 * 5e-6 + v / 4 / 2 / intra + 3 * (4 * 5e-6 + v / 4 / intra)
    assert AlphaBeta().seconds(Op.ALL_GATHER, ("node", "gpu", "lane"), v, mesh, Collectives.HO_RING) == pytest.approx(
        max(node, inside) + min(node, inside) / 4)
    # lane, not named, goes through gpu's named link; named, it has its own
    on_gpu = _links("gpu=200GB/s@5us").seconds(Op.ALL_GATHER, ("gpu", "lane"), v, mesh, Collectives.RING)
    assert on_gpu == pytest.approx(7 * 5e-6 + 7 / 8 * v / 200e9)
    apart = _links("gpu=100GB/s@5us", "lane=100GB/s").seconds(Op.ALL_GATHER, ("gpu", "lane"), v, mesh, Collectives.RING)
    assert apart == pytest.approx(7 * 5e-6 + 6 / 8 * 7 / 8 * v / intra)


def test_explain_on_a_split_node_with_the_two_tier_default(tmp_path, capsys):
    # Real strategy text through explain with --intra/--inter only: a node split as
    # gpu(2) > lane(4) predicts what the same node as gpu(8) predicts.
    def explain(mesh, scope):
        f = tmp_path / f"{scope.replace(', ', '_')}.shard"
        f.write_text(f"strategy s\nmesh {mesh}\nparams shard over {scope}\ngrads shard over {scope}\n"
                     f"optim shard over {scope}\ncollectives ring\n")
        assert run_cmd("explain", [str(f), "--model", TINY, "--tokens", "16", "--seq", "8", "--tflops", "1e-3",
                                   "--intra", "20GB/s", "--inter", "2GB/s", "--json"]) == 0
        return json.loads(capsys.readouterr().out)
    one = explain("node(2) > gpu(8)", "gpu")
    split = explain("node(2) > gpu(2) > lane(4)", "gpu, lane")
    assert split["time"]["total"] == pytest.approx(one["time"]["total"], rel=1e-9)
    assert (one["shared_links"], split["shared_links"]) == ({}, {"lane": "gpu"})
    f = tmp_path / "gpu_lane.shard"
    assert run_cmd("explain", [str(f), "--model", TINY, "--tokens", "16", "--seq", "8"]) == 0
    assert "lane (on gpu's link)" in capsys.readouterr().out
    assert run_cmd("explain", [str(f), "--model", TINY, "--tokens", "16", "--seq", "8", "--link", "lane=50GB/s"]) == 0
    assert "on gpu's link" not in capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_graph():
    from shardc import load_strategy
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.analysis.costmodel.flops import trace
    from shardc.cli.loader import build_model
    from shardc.units import find_units
    m = build_model(TINY, device="meta")
    s = resolve_bucket(m, load_strategy("strategy a\nmesh gpu(2)\n"))
    return trace(m, find_units(m, s), batch=2, seq=8, dtype="bf16"), trace(m, find_units(m, s), batch=1, seq=8)


def test_flops_from_the_graph_include_attention(tiny_graph):
    g, _ = tiny_graph
    # llama_tiny: dim 18, 3 heads, ffn 37, vocab 101, 2 blocks; 2 sequences of 8 tokens.
    linear = 2 * (4 * 18 * 18 + 3 * 18 * 37) + 18 * 101          # matmul weights (embedding: a lookup)
    attention = 2 * 4 * 2 * 8 * 8 * 18                             # 4·b·s²·(h·d) per block, not halved
    assert g.forward_flops == 2 * 16 * linear + attention
    assert g.model_flops == 3 * g.forward_flops
    # backward: matmuls twice the forward; flash attention's backward 2.5× its forward
    assert g.backward_flops == 2 * 2 * 16 * linear + 2.5 * attention
    assert g.executed_flops(checkpoint=True) == g.executed_flops() + sum(g.unit_forward_flops[1:])
    assert g.tokens == 16


def test_activations_per_unit_and_checkpointing(tiny_graph):
    from shardc.analysis.costmodel.activations import activation_bytes, peak_memory
    g, g1 = tiny_graph
    assert g.inputs[1:] == (2 * 8 * 18 * 2,) * 2                     # a block's input: b·s·dim bf16
    full, ckpt = activation_bytes(g), activation_bytes(g, checkpoint=True)
    assert full == sum(g.saved) and ckpt == g.saved[0] + sum(g.inputs[1:]) + max(g.saved[1:])
    assert ckpt < full
    assert activation_bytes(g1) < full                                # one sequence saves less
    p = peak_memory({"total": 1000, "transient": 10}, g, overhead=5)
    assert p["peak"] == 1000 + 10 + full + 5 and p["dominant"] == "activations"


def test_explain_prints_step_time_tokens_and_mfu(capsys):
    assert run_cmd("explain", ["examples/strategies/zero3.shard", "--model", TINY, "--mesh", "node(2) > gpu(2)",
                               "--tokens", "16", "--seq", "8", "--tflops", "1e-6", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    t, r = d["time"], d["rates"]
    m = d["micro_batches"]
    assert r["tokens_per_s"] == pytest.approx(m * 16 / t["total"])
    assert r["mfu"] == pytest.approx(m * r["model_flops"] / (t["total"] * 312e12))
    assert d["peak"]["peak"] == max(t["bytes"] for t in d["peak"]["timeline"]) + d["peak"]["overhead"]   # the timeline's max
    assert run_cmd("explain", ["examples/strategies/zero3.shard", "--model", TINY, "--mesh", "node(2) > gpu(2)",
                               "--link", "node=1GB/s", "--link", "gpu=10GB/s"]) == 0
    out = capsys.readouterr().out
    assert "MFU" in out and "tokens/s" in out and "peak memory per rank" in out and "dominated by" in out


def _plan(capsys, *extra):
    assert run_cmd("plan", ["--model", TINY, "--mesh", "node(2) > gpu(2)", "--memory", "3GiB", "--top", "16",
                            "--tokens", "16", "--seq", "8", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_objective_and_peak_memory_bind(capsys):
    by_time, by_comm = _plan(capsys), _plan(capsys, "--objective", "comm")
    steps = [round(r["step_seconds"], 9) for r in by_time["ranking"]]
    comms = [round(r["comm_seconds"], 9) for r in by_comm["ranking"]]
    assert steps == sorted(steps) and comms == sorted(comms)
    assert by_time["why"].startswith("#1") and by_comm["objective"] == "comm"
    a, b = by_time["ranking"][:2]
    # #1 is faster here; the line names the phase where #2 sends the most more, in readable units.
    more = {k: b["comm_by_phase"][k] - a["comm_by_phase"][k] for k in a["comm_by_phase"]}
    phase = max(more, key=more.get)
    assert a["step_seconds"] < b["step_seconds"] and more[phase] > 0
    assert f"more in the {phase} phase" in by_time["why"] and " 0.0 " not in by_time["why"]
    # The budget binds on the peak (states + gathered + activations + overhead), not on states.
    peaks = sorted(r["peak"]["peak"] for r in by_time["ranking"])
    budget = peaks[len(peaks) // 2]
    d = _plan(capsys, "--memory", f"{budget}B")      # the last --memory wins
    assert 0 < d["fit"] < 16 and all(r["memory"] == r["peak"]["peak"] <= budget for r in d["ranking"])
    assert all(r["peak"]["activations"] > 0 for r in d["ranking"])


def test_link_and_profile_are_exclusive(tmp_path):
    f = tmp_path / "bw.json"
    f.write_text('{"entries": []}')
    with pytest.raises(ShardcError, match="--link and --bandwidth"):
        run_cmd("explain", ["examples/strategies/zero3.shard", "--model", TINY, "--mesh", "node(2) > gpu(2)",
                            "--bandwidth", str(f), "--link", "node=1GB/s"])


def test_printed_times_read_in_their_own_unit():
    # `plan` and `explain` print µs below 1 ms, ms below 10 s, seconds above (Lins' 30B
    # on one node plans steps of 756 s, unreadable as 755920.3 ms).
    from shardc.dsl.quantities import duration
    assert [duration(x) for x in (0.0, 2e-5, 1.1015, 9.99, 755.92)] == \
        ["0.0 ms", "20.0 us", "1101.5 ms", "9990.0 ms", "755.92 s"]


def test_a_profile_composes_in_node_stages_on_one_link():
    # [Note: one in-node link] for a measured profile: an ho-ring composed from one-level
    # entries runs the gpu and lane stages in turn on the node's link, beside the node stage.
    from shardc import load_strategy
    from shardc.analysis.costmodel.profile import Profile
    mesh = load_strategy("strategy a\nmesh node(2) > gpu(2) > lane(4)\n").mesh
    rates = {"node": 10e9, "gpu": 10e9, "lane": 20e9}       # constant bandwidth: seconds = bytes / rate
    p = Profile({(Op.ALL_GATHER, (l,), "ring", "fp32"): ((1e3, 1e3 / w, 0.0), (1e12, 1e12 / w, 0.0))
                 for l, w in rates.items()})
    v = 8e9
    node, gpu, lane = v / 8 / 10e9, v / 4 / 10e9, v / 20e9  # stage payloads V / (inner sizes)
    inside = gpu + lane                                      # > node: the in-node link is the slowest
    assert p.seconds(Op.ALL_GATHER, ("node", "gpu", "lane"), v, mesh, Collectives.HO_RING) == pytest.approx(
        max(node, inside) + min(node, inside) / 4)
    assert (p.key(mesh, "lane"), p.key(mesh, "gpu"), p.key(mesh, "node")) == ("gpu", "gpu", "node")


def test_a_profile_composes_ho_ring_from_its_pieces():
    # [Note: staged algorithms] with measured stages: ho-ring runs each stage on its pieces
    # pieces, so a stage costs `pieces` measured rings on a quarter of its payload (each
    # paying its own latency); hierarchical one ring on the whole payload. Entries are
    # measured at exactly the payloads used, seconds = latency + bytes / rate.
    from shardc import load_strategy
    from shardc.analysis.costmodel.profile import Profile
    mesh = load_strategy("strategy a\nmesh node(2) > gpu(4)\n").mesh
    link = {"node": (2e-3, 5e6), "gpu": (5e-4, 3e8)}
    sizes = (1e6, 4e6, 16e6)
    p = Profile({(Op.ALL_GATHER, (l,), "ring", "fp32"): tuple((b, a + b / w, 0.0) for b in sizes)
                 for l, (a, w) in link.items()})
    t = lambda l, b: link[l][0] + b / link[l][1]
    v = 16e6                                    # node stage payload v/4, gpu stage v
    node, gpu = 4 * t("node", v / 4 / 4), 4 * t("gpu", v / 4)
    assert p.seconds(Op.ALL_GATHER, ("node", "gpu"), v, mesh, Collectives.HO_RING) == pytest.approx(
        max(node, gpu) + min(node, gpu) / 4)
    assert p.seconds(Op.ALL_GATHER, ("node", "gpu"), v, mesh, Collectives.HIERARCHICAL) == pytest.approx(
        t("node", v / 4) + t("gpu", v))


def test_a_profile_below_its_smallest_size_keeps_the_latency():
    # [Note: below the measured sizes]: the line through the two smallest points.
    from shardc import load_strategy
    from shardc.analysis.costmodel.profile import Profile
    mesh = load_strategy("strategy a\nmesh node(2) > gpu(4)\n").mesh
    a, w = 2e-3, 5e6
    p = Profile({(Op.ALL_GATHER, ("node",), "ring", "fp32"): tuple((b, a + b / w, 0.0) for b in (1e6, 2e6, 8e6))})
    assert p.seconds(Op.ALL_GATHER, ("node",), 2.5e5, mesh, Collectives.RING) == pytest.approx(a + 2.5e5 / w)
    one = Profile({(Op.ALL_GATHER, ("node",), "ring", "fp32"): ((1e6, 0.2, 0.0),)})   # one point: no latency known
    assert one.seconds(Op.ALL_GATHER, ("node",), 2.5e5, mesh, Collectives.RING) == pytest.approx(0.05)
