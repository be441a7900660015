"""Every ds_config example on docs/deepspeed.md converts (`shardc.from_deepspeed_config`) to a
strategy that `shardc.load_strategy` accepts, with the scopes its ZeRO stage means; the page's
shown output is what the converter writes; offload is refused in one sentence. No DeepSpeed
needed: the converter reads a dict."""
from __future__ import annotations

import json
import os
import re

import pytest

import shardc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "deepspeed.md")
CHECK_MESH = "node(2) > gpu(8)"


def _blocks():
    text = open(PAGE).read()
    return re.findall(r"```(json|)\n(.*?)```", text, re.S)


def _examples():
    return [json.loads(body) for kind, body in _blocks() if kind == "json"]


def _sharded(strategy):
    sc = strategy.scopes
    return tuple(set(getattr(sc, s).levels) == {"node", "gpu"} for s in ("params", "grads", "optim"))


def test_the_page_has_examples():
    assert len(_examples()) >= 5


@pytest.mark.parametrize("i", range(5))
def test_every_example_checks(i):
    cfg = _examples()[i]
    zero = cfg["zero_optimization"]
    hpz = zero.get("zero_hpz_partition_size", 1)
    mesh = f"node(*) > gpu({hpz})" if hpz > 1 else "node(*) > gpu(local)"
    if any((zero.get(k) or {}).get("device", "none") != "none" for k in ("offload_optimizer", "offload_param")):
        with pytest.raises(shardc.ShardcError, match="offload_optimizer .* has no shardc equivalent") as e:
            shardc.from_deepspeed_config(cfg, mesh=mesh)
        assert "\n" not in str(e.value)
        return
    text = shardc.from_deepspeed_config(cfg, mesh=mesh)
    s = shardc.load_strategy(text, mesh=f"node(2) > gpu({hpz})" if hpz > 1 else CHECK_MESH)
    stage = zero["stage"]
    want = {1: (False, False, True), 2: (False, True, True), 3: (True, True, True)}[stage]
    assert _sharded(s) == want, text
    if hpz > 1:
        assert s.scopes.params.secondary is not None
    if "reduce_bucket_size" in zero:
        assert s.bucket == int(float(zero["reduce_bucket_size"])) * 4     # elements of fp32 -> bytes
    if cfg.get("gradient_accumulation_steps", 1) > 1:
        assert s.accumulate == cfg["gradient_accumulation_steps"]


def test_the_shown_output_is_the_converters():
    blocks = _blocks()
    first = next(i for i, (k, _) in enumerate(blocks) if k == "json")
    shown = blocks[first + 1][1]
    assert shardc.from_deepspeed_config(json.loads(blocks[first][1])) == shown


def test_hpz_that_is_not_the_node_is_refused():
    cfg = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}
    with pytest.raises(shardc.ShardcError, match="zero_hpz_partition_size 4 is not the node's 8 GPUs"):
        shardc.from_deepspeed_config(cfg, mesh="node(*) > gpu(8)")
