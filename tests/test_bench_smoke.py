"""Smoke test of the emulated-cluster benchmark (bench/cluster_bench.py).

Runs the real harness on 2 network namespaces x 2 gloo ranks for one step (plus one
system that fails, which must be reported while the others still run) and checks
the JSON it writes, the memory and link-byte figures against formulas written out
here, and that no namespace of the run is left behind (after success, after an error
inside the context manager, and after Ctrl-C). Opt-in (`pytest -m netns` or
SHARDC_NETNS=1, see tests/conftest.py); needs root and iproute2, skipped with that
reason anywhere else.

Without namespaces: the `+tp` systems (bench/peers/systems.py [Note: +tp systems]) run one
warm-up and one timed step of the tiny model through the worker's own `run_system` on 8
gloo ranks as (node 2, gpu 2, tp 2): the same losses for FSDP2 and shardc, one batch per
tp pair, memory per rank and FSDP2's link bytes against formulas written out here. The
system names' suffixes parse ([Note: system suffixes]), and the compiled systems
`fsdp2:full+compile` and `shardc:zero3+inductor` build and train one warm-up and one timed
step of the tiny model on 2 gloo ranks with the same losses (no timings asserted).
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

from netns import (ClusterError, ClusterSpec, EmulatedCluster, leftover_namespaces,  # noqa: E402
                   remove_stale, require_root_and_tools)

from tests.harness import HANG_S, dist_run  # noqa: E402

try:
    require_root_and_tools()
    SKIP = None
except ClusterError as e:
    SKIP = str(e)
_root = pytest.mark.skipif(SKIP is not None, reason=f"emulated cluster unavailable: {SKIP}")


def needs_root(fn):
    """An emulated-cluster test: opt-in by the `netns` marker, and skipped without root."""
    return pytest.mark.netns(_root(fn))


def _bench(args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(BENCH, "cluster_bench.py"), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@needs_root
def test_one_step_two_nodes_two_ranks(tmp_path):
    out = tmp_path / "bench.json"
    p = _bench(["--nodes", "2", "--per-node", "2", "--inter-rate", "1gbit", "--model", "small",
                "--accumulate", "2", "--micro-batch", "2", "--warmup", "1", "--steps", "1",
                "--systems", "ddp,shardc:no_such_strategy,fsdp2:full", "--json", str(out),
                "--logdir", str(tmp_path)])
    log, _ = p.communicate(timeout=HANG_S)
    assert p.returncode == 0, log
    assert leftover_namespaces(f"shardc-{p.pid}-") == []
    doc = json.loads(out.read_text())
    assert doc["config"]["world"] == 4
    ddp, fsdp = doc["systems"]["ddp"], doc["systems"]["fsdp2:full"]
    # A failing system is reported with its error; the ones after it still ran.
    assert "no strategy file" in doc["systems"]["shardc:no_such_strategy"]["error"]
    for r in (ddp, fsdp):
        assert "error" not in r, r.get("error")
        assert r["step_time_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(4 * 2 * 2 * 64 / r["step_time_s"])  # world*acc*mb*T
    phi = ddp["params"]
    # DDP: every rank holds fp32 params, grads and AdamW's exp_avg, exp_avg_sq: 16 bytes each.
    assert ddp["model_state_bytes"] == 16 * phi
    # FSDP2 shards dim 0 of every parameter over 4 ranks (rank 0 holds ceil(d0/4) rows).
    import torch
    sys.path.insert(0, ROOT)
    from models import build_model
    model = build_model("small")
    seen, chunk = set(), 0
    for prm in model.parameters():
        if id(prm) not in seen:
            seen.add(id(prm))
            chunk += math.ceil(prm.shape[0] / 4) * (prm.numel() // prm.shape[0])
    assert fsdp["model_state_bytes"] == 16 * chunk
    # Between micro-batches (gradient sync off) FSDP2 holds every unsharded fp32 gradient
    # instead of the grad shard: params + exp_avg + exp_avg_sq shards + 4*phi.
    assert fsdp["peak_model_state_bytes"] == 12 * chunk + 4 * phi
    assert ddp["peak_model_state_bytes"] == ddp["model_state_bytes"]
    # DDP's one ring all-reduce of V = 4*phi bytes over 4 ranks on 2 nodes: 2 of the 4
    # ring edges cross nodes, each carrying 2*(3/4)*V; averaged per rank: 2/4*2*3/4*V.
    ring_node = 2 / 4 * 2 * 3 / 4 * 4 * phi
    assert ddp["level_bytes"]["node"] == pytest.approx(ring_node)
    # ...and that is what the shaped veths carried (TCP/IP headers and barriers on top).
    assert ring_node <= ddp["measured_bytes"]["node"] <= 1.1 * ring_node


@needs_root
def test_bandwidth_profile_on_the_cluster(tmp_path):
    prof = tmp_path / "profile.json"
    p = _bench(["--nodes", "2", "--per-node", "2", "--inter-rate", "1gbit", "--model", "bench",
                "--micro-batch", "1", "--steps", "1", "--warmup", "0", "--bandwidth-profile", str(prof),
                "--profile-sizes", "64KiB", "--profile-comm", "fp32,int8", "--json", str(tmp_path / "run.json"),
                "--logdir", str(tmp_path)])
    log, _ = p.communicate(timeout=HANG_S)
    assert p.returncode == 0, log
    assert leftover_namespaces(f"shardc-{p.pid}-") == []
    doc = json.loads(prof.read_text())
    assert doc["mesh"] == [{"name": "node", "size": 2}, {"name": "gpu", "size": 2}]
    # fp32: 3 ops on node, 3 on gpu, 3 ops × 3 algorithms on node+gpu (15); int8: all_gather
    # (1 + 1 + 3) and the all_to_all (ring only, 1 + 1 + 1) (8) — one size each.
    assert len(doc["entries"]) == 15 + 8
    assert all(e["seconds"] > 0 and e["cpu_seconds"] > 0 for e in doc["entries"])
    q = [e for e in doc["entries"] if e["comm"] == "int8" and e["op"] == "all_gather" and e["levels"] == ["gpu"]]
    # the ledger's payload: 2 shards of 8192 elements as int8 codes + one fp32 scale per 256
    assert q[0]["bytes"] == 2 * (8192 + 8192 // 256 * 4)
    c = doc["compute"]
    assert (c["model"], c["tokens"], c["seq"]) == ("bench/models.py:bench", 64, 64)
    assert c["flops_per_s"] == pytest.approx(c["flops"] / c["seconds"]) and c["cpu_seconds"] > 0


@needs_root
def test_teardown_on_error():
    spec = ClusterSpec(nodes=2, per_node=1, rate="100mbit")
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(spec, prefix=f"shardc-{os.getpid()}-err") as c:
            assert len(leftover_namespaces(c.prefix)) == 3      # 2 nodes + the switch
            c.popen(0, ["sleep", "30"])
            raise RuntimeError("boom")
    assert leftover_namespaces(f"shardc-{os.getpid()}-err") == []


@needs_root
def test_teardown_on_ctrl_c(tmp_path):
    p = _bench(["--nodes", "2", "--per-node", "1", "--model", "tiny", "--steps", "1000",
                "--systems", "ddp", "--json", str(tmp_path / "x.json")])
    deadline = time.monotonic() + HANG_S
    while len(leftover_namespaces(f"shardc-{p.pid}-")) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(leftover_namespaces(f"shardc-{p.pid}-")) == 3
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    log, _ = p.communicate(timeout=HANG_S)
    assert p.returncode == 130, log
    assert "torn down" in log
    assert leftover_namespaces(f"shardc-{p.pid}-") == []


@needs_root
def test_removes_namespaces_of_killed_runs():
    dead = subprocess.Popen(["true"])
    dead.wait()                                   # its pid now names no process
    stale, live = f"shardc-{dead.pid}-n0", f"shardc-{os.getpid()}-live-n0"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert stale in remove_stale()
        assert leftover_namespaces(stale) == []
        assert leftover_namespaces(live) == [live]   # our own (live) run is left alone
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


TP_SYSTEMS = ("fsdp2+tp", "shardc:zero3+tp", "shardc:paro_iig+tp")


def _run_systems(rank, world, names, per_node):
    """Each system's `worker.run_system` on this rank, one warm-up and one timed step of
    the tiny model on 2 nodes of `per_node` ranks: {name: its result}."""
    import argparse

    from tests.bench_modules import load_bench
    worker = load_bench("worker")
    args = argparse.Namespace(model="tiny", nodes=2, per_node=per_node, accumulate=2, micro_batch=2, steps=1,
                              warmup=1, profile=None, progress=None)
    out = {}
    for name in names:
        args.system = name
        out[name] = worker.run_system(args, rank, rank % per_node)
    return out


def _tp_local_numels():
    """[root, block 1, ...] elements one tp rank of 2 holds: in every block, attn.c_attn and
    mlp.c_fc keep half their rows (weight and bias), the c_proj's half their weight's
    columns (bias whole); the rest is replicated. The tied head is counted once."""
    sys.path.insert(0, ROOT)
    from examples.gpt import tiny
    sizes = {}
    for name, p in tiny().named_parameters():          # tied lm_head.weight is not listed again
        halved = any(k in name for k in ("c_attn.", "c_fc.")) or name.endswith("c_proj.weight")
        unit = int(name.split(".")[2]) + 1 if name.startswith("transformer.h.") else 0
        sizes[unit] = sizes.get(unit, 0) + p.numel() // (2 if halved else 1)
    return [sizes[u] for u in sorted(sizes)]


def test_tp_systems_train_alike_without_namespaces():
    from tests.bench_modules import load_bench
    runs = dist_run(8, _run_systems, TP_SYSTEMS, 4)
    sizes = _tp_local_numels()
    # dp 4: every parameter of the tiny model splits into whole rows over 4 ranks here, so a
    # fully sharded rank holds 1/4 of its tp shard's fp32 params, grads, exp_avg, exp_avg_sq
    full_shard = 16 * sum(sizes) // 4
    for name in TP_SYSTEMS:
        r0, r1, r2 = (runs[r][name] for r in (0, 1, 2))
        assert r0["tp"] == 2 and r0["mesh"] == [["node", 2], ["gpu", 2]]
        assert r0["tokens_per_step"] == 4 * 2 * 2 * 16           # dp ranks * accumulate * micro * T
        # a tp pair reads one batch and computes one loss; the next dp rank another
        assert r0["losses"] == pytest.approx(r1["losses"], rel=1e-6)
        assert r0["losses"] != pytest.approx(r2["losses"], rel=1e-3)
        # the same model, data and optimizer: the same losses, step after step
        assert r0["losses"] == pytest.approx(runs[0]["fsdp2+tp"]["losses"], rel=1e-5)
    for name in ("fsdp2+tp", "shardc:zero3+tp"):
        assert {runs[r][name]["state_bytes"] for r in range(8)} == {full_shard}
    fsdp = runs[0]["fsdp2+tp"]
    assert fsdp["unit_numels"] == sizes
    # FSDP2 over the dp ring of 4 ranks on 2 nodes: 2 of its 4 edges cross nodes, each
    # collective moves 3/4 of V per rank; per step: M forward all-gathers of every unit, M
    # backward ones of every block, one reduce-scatter of every unit (fp32, M = 2).
    report = load_bench("report")
    res = dict(fsdp, ledger_steps=1, per_rank=[{"state_bytes": full_shard, "peak_state_bytes": full_shard}])
    summary = report.summarize("fsdp2+tp", res, "tiny", 2, 4, 2)
    moved = 4 * (2 * sum(sizes) + 2 * sum(sizes[1:]) + sum(sizes))
    assert summary["level_bytes"]["node"] == pytest.approx(2 / 4 * 3 / 4 * moved)


def test_system_names_parse():
    from peers.systems import SystemName as Name, parse_system as parse      # bench/ is on sys.path
    assert parse("fsdp2:full") == Name("fsdp2:full")
    assert parse("fsdp2+tp") == Name("fsdp2:full", tp=2)
    assert parse("shardc:zero3@ring+tp4") == Name("shardc:zero3@ring", tp=4)
    assert parse("fsdp2:full+compile") == parse("fsdp2+compile") == Name("fsdp2:full", compile=True)
    assert parse("fsdp2:hsdp+compile+tp") == parse("fsdp2:hsdp+tp+compile") == Name("fsdp2:hsdp", 2, compile=True)
    assert parse("ddp+compile") == Name("ddp", compile=True)
    assert parse("shardc:zero3+inductor") == Name("shardc:zero3", inductor=True)
    assert parse("shardc:paro_iig@ho-ring+inductor") == Name("shardc:paro_iig@ho-ring", inductor=True)
    for bad, why in [("shardc:zero3+compile", "whole step with \\+inductor"), ("fsdp2:full+inductor", "a peer takes"),
                     ("shardc:zero3+inductor+tp", "tensor-parallel"), ("ddp+tp", "fsdp2 or shardc"),
                     ("shardc:zero3+inductor+inductor", "twice"), ("fsdp2:full+jit", "unknown suffix"),
                     ("megatron+compile", "unknown system")]:
        with pytest.raises(ValueError, match=why):
            parse(bad)


COMPILED_SYSTEMS = ("fsdp2:full+compile", "shardc:zero3+inductor")


def test_compiled_systems_build_and_train_alike():
    """One warm-up step (where they compile) and one timed step on node(2) > gpu(1)."""
    runs = dist_run(2, _run_systems, COMPILED_SYSTEMS, 1)
    fsdp, sc = (runs[0][n] for n in COMPILED_SYSTEMS)
    assert sc["backend"] == "inductor"
    assert len(fsdp["warmup_times"]) == len(sc["warmup_times"]) == 1
    assert len(fsdp["losses"]) == 2
    assert fsdp["losses"] == pytest.approx(sc["losses"], rel=1e-4)
    assert runs[0][COMPILED_SYSTEMS[0]]["losses"] != pytest.approx(runs[1][COMPILED_SYSTEMS[0]]["losses"], rel=1e-3)
    # both shard every state over the 2 ranks; between micro-batches FSDP2 also holds its
    # unsharded gradients (gradient sync off), shardc none
    assert fsdp["state_bytes"] == sc["state_bytes"] == sc["peak_state_bytes"] < fsdp["peak_state_bytes"]
    assert all(r[n]["peak_rss_bytes"] > 0 for r in runs for n in COMPILED_SYSTEMS)


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="needs root"):
        require_root_and_tools()


def test_refuses_without_iproute2(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    import shutil
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "tc" else "/usr/sbin/ip")
    with pytest.raises(ClusterError, match="missing: tc"):
        require_root_and_tools()
