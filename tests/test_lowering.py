"""The lowering's per-unit scopes: stacked `override` blocks stay partial and resolve per
state, the last matching block that mentions a state winning (docs/language.md).

The issue's example as real `.shard` text — top level params/grads over gpu, optim over
the world; `override "blocks.0" { params, grads over world }` then `override "blocks.*"
{ optim over world }` — must give blocks.0 world/world/world. Checked three ways: the
lowering's unit scopes, `shardc explain --json` memory and ledger, and a 4-rank run's
`memory_report()`. Expected bytes come from docs/internals.md, written out by hand.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from shardc.dsl import load_strategy
from shardc.dsl.errors import ShardcError
from shardc.lowering import Schedule, Stage, schedule, unit_scopes
from tests.harness import dist_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = """mesh node(2) > gpu(2)
params shard over gpu
grads  shard over gpu
optim  shard over world
override "blocks.0" {
    params shard over world
    grads  shard over world
}
override "blocks.*" {
    optim shard over world
}
"""
WORLD, GPU = ("node", "gpu"), ("gpu",)


class Net(nn.Module):
    """Root: emb (64 elements); units blocks.0 and blocks.1 (64 elements each)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 8, bias=False)
        self.blocks = nn.ModuleList([nn.Linear(8, 8, bias=False) for _ in range(2)])

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def net() -> Net:
    return Net()


def _levels(scopes):
    return scopes.params.levels, scopes.grads.levels, scopes.optim.levels


def test_stacked_overrides_resolve_per_state():
    s = load_strategy(TEXT, world_size=4)
    assert s.overrides[0].optim is None and s.overrides[1].params is None      # partial in the IR
    assert _levels(unit_scopes(s, "blocks.0", ("blocks.0",))[0]) == (WORLD, WORLD, WORLD)
    assert _levels(unit_scopes(s, "blocks.1", ("blocks.1",))[0]) == (GPU, GPU, WORLD)
    assert _levels(unit_scopes(s, "<root>")[0]) == (GPU, GPU, WORLD)


def test_later_block_wins_for_a_state_both_mention():
    s = load_strategy(TEXT + 'override "blocks.[0]" {\n    params replicate\n}\n', world_size=4)
    scopes, used = unit_scopes(s, "blocks.0", ("blocks.0",))
    assert used == (0, 1, 2)
    assert _levels(scopes) == ((), WORLD, WORLD)          # params from the last block, grads from the first


def test_stacked_blocks_breaking_the_rule_name_the_unit():
    text = """mesh node(2) > gpu(2)
params replicate
grads  shard over gpu
optim  shard over gpu
override "blocks.*" { params shard over gpu }
override "blocks.0" { grads replicate }
"""
    s = load_strategy(text, world_size=4)             # each block alone is fine over the top level
    with pytest.raises(ShardcError, match=r":6: unit blocks\.0 breaks the dependency rule.*lines 5, 6.*"
                                          r"params shard over gpu but grads does not"):
        unit_scopes(s, "blocks.0", ("blocks.0",))


def test_schedule_stages_by_prefetch():
    assert schedule([True, True, True, True], 1) == Schedule(
        forward=(Stage(0, (0, 1)), Stage(1, (2,)), Stage(2, (3,)), Stage(3, ())),
        backward=(Stage(3, (3, 2)), Stage(2, (1,)), Stage(1, ())))
    assert schedule([False, True, False, True], 0) == Schedule(
        forward=(Stage(0, ()), Stage(1, (1,)), Stage(2, ()), Stage(3, (3,))),
        backward=(Stage(3, (3,)), Stage(2, ()), Stage(1, (1,))))


# By hand (internals.md "Memory", fp32, AdamW K = 8, no padding: 64 divides by 4):
# root and blocks.1: P = G = gpu (2), OS = world (4); blocks.0: P = G = OS = world (4).
EXPECTED = dict(params=64 * 4 // 2 + 64 * 4 // 4 + 64 * 4 // 2,          # 320 (gpu params back would give 384)
                params_secondary=0,
                grads=64 * 4 // 2 + 64 * 4 // 4 + 64 * 4 // 2,
                optim=3 * 64 * 8 // 4)
EXPECTED["total"] = sum(EXPECTED.values())


def test_explain_json_uses_the_per_unit_scopes(tmp_path):
    path = tmp_path / "stacked.shard"
    path.write_text(TEXT)
    r = subprocess.run([sys.executable, "-m", "shardc.cli", "explain", str(path), "--model",
                        "tests/test_lowering.py:net", "--world", "4", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {k: doc["memory"][k] for k in EXPECTED} == EXPECTED
    ledger = {(e["phase"], e["op"], tuple(e["levels"]), e["bytes"]): e["count"] for e in doc["ledger"]}
    # forward gathers: N·4 = 256 bytes; blocks.0 over the world, root and blocks.1 over gpu
    assert ledger[("forward", "all_gather", WORLD, 256)] == 1
    assert ledger[("forward", "all_gather", GPU, 256)] == 2
    # sync reduce-scatter over OS∖G = node of N/s_G·4 = 128 bytes: root and blocks.1 only
    assert ledger[("sync", "reduce_scatter", ("node",), 128)] == 2


def _memory(rank, world):
    import shardc
    torch.manual_seed(0)
    sm = shardc.compile(Net(), TEXT, capture="fx")
    opt = sm.optimizer(torch.optim.AdamW, lr=1e-3)
    x = torch.randn(world * 2, 8).chunk(world)[rank]
    sm(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return sm.memory_report()


@pytest.mark.distributed
def test_run_memory_report_uses_the_per_unit_scopes():
    for rep in dist_run(4, _memory):
        assert rep == EXPECTED
