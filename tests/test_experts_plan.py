"""Experts on their own mesh in the plan: the `experts` statement's real text through the
unit finder, the sizes, the lowering and `explain` (issue: expert parallelism).

A tiny MoE model (blocks of an attention linear and an `experts` module holding 3-D
w1/w2, dim 0 the experts) on node(2) > gpu(4). Every expected figure is written out from
the formulas of docs/internals.md "Ledger" and "Memory" on the experts' mesh (the level ep
borrows from divided by ep), not read from the code.
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import shardc
from shardc.analysis.costmodel.report import explain, model_units
from shardc.dsl.errors import ShardcError
from shardc.lowering import Over

E, H, F, LAYERS = 8, 16, 32, 2
EXPERT = E * (F * H + H * F)          # one block's expert elements, all experts
DENSE = H * H + H                     # one block's attention linear


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(E, F, H))
        self.w2 = nn.Parameter(torch.empty(E, H, F))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(H, H)
        self.experts = Experts()


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))


def moe():
    with torch.device("meta"):
        return MoE()


def load(name):
    return shardc.load_strategy(f"examples/strategies/moe/{name}.shard", world_size=8)


@pytest.fixture(autouse=True)
def _local4(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")


def expert_groups(strategy):
    plan = explain(strategy, model_units(strategy, moe())).plan
    blocks = plan.units[1:]
    assert len(blocks) == LAYERS and all(g.placement.over == Over.DENSE for g in plan.units[0].groups)
    return plan, [next(g for g in u.groups if g.placement.over == Over.EXPERTS) for u in blocks], blocks


def rows(g):
    return {(r.phase.value, r.op.value, r.levels, r.bytes) for r in g.rows}


def test_ep2_zero3_shards_the_experts_over_the_ranks_ep_leaves():
    # ep 2 of gpu(4): each rank holds E/2 experts, ZeRO-3 over node(2) x gpu(4/2) = 4 ranks
    plan, groups, blocks = expert_groups(load("ep2_zero3"))
    local = EXPERT // 2
    for u, g in zip(blocks, groups):
        assert (g.phi, g.n) == (local, local)                       # 4 divides it: no padding
        assert (g.factors.p, g.factors.g, g.factors.os) == (4, 4, 4)
        assert (u.factors.p, u.factors.os) == (8, 8)                # dense: every rank
        assert g.params_bytes == local // 4 * 4 and g.grads_bytes == local // 4 * 4
        assert g.optim_elems == local // 4 and g.gathered_bytes == local * 4
        assert rows(g) == {("forward", "all_gather", ("node", "gpu"), local * 4),
                           ("backward", "all_gather", ("node", "gpu"), local * 4),
                           ("backward", "reduce_scatter", ("node", "gpu"), local * 4)}
        assert all(r.over == Over.EXPERTS for r in g.rows) and g.placement.mesh == load("ep2_zero3").expert_mesh
        dense = next(d for d in u.groups if d.placement.over == Over.DENSE)
        assert dense.phi == DENSE and all(r.over == Over.DENSE for r in dense.rows)
    # one clip all-reduce: the experts' OS levels plus gpu are the dense optimizer's levels
    assert [(r.levels, r.bytes) for r in plan.clip_rows] == [(("node", "gpu"), 4)]


def test_ep_a_whole_level_leaves_the_experts_the_nodes():
    # ep gpu: E/4 experts per rank, data-parallel over node(2) only
    _, groups, blocks = expert_groups(load("ep_zero3"))
    local = EXPERT // 4
    for u, g in zip(blocks, groups):
        assert (g.factors.p, g.factors.g, g.factors.os) == (2, 2, 2)
        assert g.params_bytes == local // 2 * 4
        assert {(p, o, b) for p, o, _, b in rows(g)} == {("forward", "all_gather", local * 4),
                                                         ("backward", "all_gather", local * 4),
                                                         ("backward", "reduce_scatter", local * 4)}


def test_paro_with_zero1_experts_syncs_them_over_the_node_once_a_step():
    plan, groups, _ = expert_groups(load("paro_iig_ep_zero1"))
    local = EXPERT // 4                 # ep gpu
    for g in groups:
        # P = G = replicate, OS = node: no per-micro-batch row; the step's reduce-scatter over
        # OS \ G = node of the whole gradient, the update all-gather over OS \ P = node
        assert rows(g) == {("sync", "reduce_scatter", ("node",), local * 4),
                           ("update", "all_gather", ("node",), local * 4)}
        assert g.params_bytes == local * 4 and g.grads_bytes == local * 4 and g.optim_elems == local // 2
    assert [(r.levels, r.bytes) for r in plan.clip_rows] == [(("node", "gpu"), 4)]


def test_hpz_experts_keep_a_secondary_copy_over_their_gpu_ranks():
    _, groups, _ = expert_groups(load("hpz_ep2"))
    local = EXPERT // 2
    for g in groups:
        # the backward re-gathers over the secondary's gpu(4/2) = 2 ranks only
        assert ("backward", "all_gather", ("gpu",), local * 4) in rows(g)
        assert g.secondary_bytes == local // 2 * 4


def test_explain_json_shows_the_experts_rows_apart(tmp_path, capsys):
    from shardc.cli import main
    (tmp_path / "moe_model.py").write_text(MODEL_SOURCE)
    argv = ["explain", "examples/strategies/moe/ep2_zero3.shard", "--model", f"{tmp_path}/moe_model.py:moe",
            "--world", "8", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    local = EXPERT // 2
    experts = [r for r in doc["ledger"] if r.get("over") == "experts"]
    assert {(r["phase"], r["op"], r["bytes"], r["count"]) for r in experts} == {
        ("forward", "all_gather", local * 4, LAYERS), ("backward", "all_gather", local * 4, LAYERS),
        ("backward", "reduce_scatter", local * 4, LAYERS)}
    # memory per rank: dense over 8 ranks, experts (E/2 of them) over 4, AdamW's 2 states
    assert doc["memory"]["params"] == (LAYERS * DENSE // 8 + LAYERS * local // 4) * 4


def test_an_expert_dim_ep_does_not_divide_is_one_sentence():
    s = load("ep2_zero3")
    model = moe()
    model.layers[0].experts.w1 = nn.Parameter(torch.empty(3, F, H, device="meta"))
    with pytest.raises(ShardcError, match=r"expert parameter 'layers.0.experts.w1' has shape \(3, 32, 16\): "
                                          r"ep 2 must divide its dim 0"):
        model_units(s, model)


def test_explain_ep_replaces_the_statements_ep(tmp_path, capsys):
    from shardc.cli import main
    (tmp_path / "moe_model.py").write_text(MODEL_SOURCE)
    argv = ["explain", "examples/strategies/moe/ep2_zero3.shard", "--model", f"{tmp_path}/moe_model.py:moe",
            "--world", "8", "--json"]
    assert main([*argv, "--ep", "gpu"]) == 0
    doc = json.loads(capsys.readouterr().out)
    local = EXPERT // 4                                  # ep 4: E/4 experts a rank, ZeRO-3 over node(2)
    assert doc["params"] == LAYERS * (DENSE + EXPERT) and doc["expert_params"] == LAYERS * EXPERT
    assert doc["memory"]["params"] == (LAYERS * DENSE // 8 + LAYERS * local // 2) * 4
    assert main([*argv, "--ep", "3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: <ep>:1:1: ep 3 does not divide level `gpu` (size 4), the innermost level it borrows "
                   "its ranks from"]
    assert main(["explain", "examples/strategies/zero3.shard", *argv[2:], "--ep", "2"]) == 1
    assert "ep 2 is given, but the strategy has no `experts` statement" in capsys.readouterr().err


def test_plan_with_ep_writes_an_experts_statement(tmp_path, capsys):
    import shardc
    from shardc.cli import main
    out = tmp_path / "best.shard"
    assert main(["plan", "--model", "examples/moe.py:moe_tiny", "--mesh", "node(2) > gpu(4)", "--memory", "3GiB",
                 "--ep", "2", "--json", "-o", str(out)]) == 0
    best = shardc.load_strategy(str(out))
    assert (best.experts.pattern, best.experts.ep, best.experts.level) == ("*.experts", 2, "gpu")
    assert best.experts.sets() == ()                     # the experts take the candidate's scopes


MODEL_SOURCE = f'''
import torch
from torch import nn

class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty({E}, {F}, {H}))
        self.w2 = nn.Parameter(torch.empty({E}, {H}, {F}))

    def forward(self, x):
        h = torch.einsum("td,efd->tef", x, self.w1).relu()
        return torch.einsum("tef,edf->td", h, self.w2) / {E}

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear({H}, {H})
        self.experts = Experts()

    def forward(self, x):
        return x + self.experts(self.attn(x))

class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range({LAYERS}))

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x.sum()

def moe():
    with torch.device("meta"):
        return MoE()
'''
