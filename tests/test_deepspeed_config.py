"""Every ds_config example on docs/deepspeed.md (each `json` block) is followed by exactly what
`shardc.from_deepspeed_config` returns for it (a `shard` block) or the one sentence it raises
(a `text` block); each strategy is one `shardc.load_strategy` accepts, with the scopes its ZeRO
stage means. No DeepSpeed needed: the converter reads a dict."""
from __future__ import annotations

import json
import os
import re

import pytest

import shardc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "deepspeed.md")
CHECK_MESH = "node(2) > gpu(8)"


def _pairs():
    """[(ds_config dict, fence of the block after it, its text)] for every `json` block."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", open(PAGE).read(), re.S | re.M)
    return [(json.loads(body), blocks[i + 1][0], blocks[i + 1][1])
            for i, (kind, body) in enumerate(blocks) if kind == "json"]


PAIRS = _pairs()


def _mesh(zero):
    g = zero.get("zero_hpz_partition_size", 1) if zero.get("zero_hpz_partition_size", 1) > 1 else \
        zero.get("mics_shard_size", -1) if zero.get("mics_shard_size", -1) > 1 else None
    return f"node(*) > gpu({g})" if g else "node(*) > gpu(local)", (f"node(2) > gpu({g})" if g else CHECK_MESH)


def _sharded(strategy):
    sc = strategy.scopes
    return tuple(set(getattr(sc, s).levels) == {"node", "gpu"} for s in ("params", "grads", "optim"))


def test_the_page_has_examples():
    assert len(PAIRS) >= 6
    assert all(kind in ("shard", "text") for _, kind, _ in PAIRS)


@pytest.mark.parametrize("i", range(len(PAIRS)))
def test_every_example_shows_what_the_converter_does(i):
    cfg, kind, shown = PAIRS[i]
    zero = cfg["zero_optimization"]
    mesh, check_mesh = _mesh(zero)
    if kind == "text":                                     # the page shows the error
        with pytest.raises(shardc.ShardcError) as e:
            shardc.from_deepspeed_config(cfg, mesh=mesh)
        assert "\n" not in str(e.value)
        assert shown == f"ShardcError: {e.value}\n"
        return
    text = shardc.from_deepspeed_config(cfg, mesh=mesh)
    assert text == shown
    s = shardc.load_strategy(text, mesh=check_mesh)
    # the scopes the stage means, from DeepSpeed's definitions: stage k shards the last k of
    # (params, grads, optim) over every rank; MiCS shards all three inside the node only
    if zero.get("mics_shard_size", -1) > 1:
        assert all(set(getattr(s.scopes, n).levels) == {"gpu"} for n in ("params", "grads", "optim")), text
    else:
        stage = zero["stage"]
        assert _sharded(s) == tuple(j >= 3 - stage for j in range(3)), text
    if zero.get("zero_hpz_partition_size", 1) > 1:
        assert s.scopes.params.secondary is not None
    if "reduce_bucket_size" in zero:
        assert s.bucket == int(float(zero["reduce_bucket_size"])) * 4     # elements of fp32 -> bytes
    if cfg.get("gradient_accumulation_steps", 1) > 1:
        assert s.accumulate == cfg["gradient_accumulation_steps"]


def test_hpz_that_is_not_the_node_is_refused():
    cfg = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}
    with pytest.raises(shardc.ShardcError, match="zero_hpz_partition_size 4 is not the node's 8 GPUs"):
        shardc.from_deepspeed_config(cfg, mesh="node(*) > gpu(8)")
