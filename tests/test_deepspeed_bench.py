"""The benchmark's DeepSpeed systems (bench/peers/ds_systems.py) train like the others: through the
worker's own step (one warm-up, one timed step of the tiny model, 2 nodes x 2 ranks, 2
micro-batches, AdamW), `deepspeed:zero1/zero2/zero3/zeropp` give the same losses as
`fsdp2:full` (the step's update included: the second step's loss depends on it), and the
results carry the ds_config used. Without namespaces (no link figures). Skips without
DeepSpeed (an optional dependency: the `deepspeed` extra)."""
from __future__ import annotations

import pytest

from tests.harness import dist_run
from tests.test_bench_smoke import _run_systems

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]'); "
                    "the DeepSpeed systems need it")
pytestmark = pytest.mark.distributed
SYSTEMS = ["fsdp2:full", "deepspeed:zero1", "deepspeed:zero2", "deepspeed:zero3", "deepspeed:zeropp"]


def test_deepspeed_systems_train_like_fsdp2():
    runs = dist_run(4, _run_systems, SYSTEMS, 2)
    for rank in runs:
        want = rank["fsdp2:full"]["losses"]
        for name in SYSTEMS[1:]:
            got = rank[name]["losses"]
            assert len(got) == len(want) == 2
            assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5 * abs(want[0]), (name, got, want)
    zpp = runs[0]["deepspeed:zeropp"]
    assert zpp["state_bytes"] > 0
    assert zpp["ds_config"]["zero_optimization"]["zero_hpz_partition_size"] == 2   # the node's ranks
    assert zpp["ds_config"]["gradient_clipping"] == 0.0


def test_mics_shards_over_the_node():
    """`deepspeed:mics` (DeepSpeed <= 0.19.6 only: 0.19.7 and 0.19.8 refuse the key, and 0.19.6's
    MiCS needs a backend with coalescing, which gloo lacks, so it is not trained here) asks for MiCS partitions of the node's ranks, on ZeRO-3."""
    from tests.bench_modules import load_bench
    zero = load_bench("peers/ds_systems").ds_config("deepspeed:mics", 4, 2, 2, 64)["zero_optimization"]
    assert zero["stage"] == 3 and zero["mics_shard_size"] == 4
