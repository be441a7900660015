"""Placement kinds (lowering/placements.py): a group is keyed by its placement, so a new
kind is one `Over` value and the file defining it. The test-only kind `vectors`
(tests/placement_vectors.py: trainable 1-D parameters replicated) is planned as its own
groups, trains at parity with one process on the concatenated batch, and its ledger
equals the plan's; outside its scope no model sees it; the whole-step mode refuses it."""
from __future__ import annotations

import copy

import pytest
import torch

import shardc
from shardc.lowering import Factors, Op, Over, Per, Phase, unit_scopes, unit_sizes
from shardc.lowering.lower import lower
from shardc.lowering.placements import kinds, registered
from tests.harness import dist_run
from tests.placement_vectors import VECTORS
from tests.test_runtime_util import Tiny, batches, loss_fn, max_rel_err, reference, units_for

ZERO3 = """\
mesh node(2) > gpu(2)
params shard over world
grads  shard over world
optim  shard over world
accumulate 2
"""
WORLD, CLIP = 4, 0.5


def _units(model, s):
    import dataclasses
    return [dataclasses.replace(u, scopes=unit_scopes(s, u.name, u.modules)[0]) for u in units_for(model, s.scopes)]


def _vectors(model, names) -> int:
    """Elements of the trainable 1-D parameters among `names` (what `vectors` takes)."""
    params = dict(model.named_parameters())
    return sum(params[n].numel() for n in names if params[n].dim() == 1)


def test_the_kind_registry_is_read_only_and_a_kind_leaves_with_its_scope():
    assert kinds() == ()
    with registered(VECTORS):
        assert kinds() == (VECTORS,)
        with pytest.raises(ValueError, match="already registered"), registered(VECTORS):
            pass
    assert kinds() == ()
    with pytest.raises(ValueError, match="already registered"), registered(type("D", (), {"over": Over.DENSE})()):
        pass


def test_a_registered_kind_is_its_own_groups_with_its_placements_rows():
    s, model = shardc.load_strategy(ZERO3), Tiny()
    units = _units(model, s)
    params = dict(model.named_parameters())
    plain = lower(s.mesh, unit_sizes(params, units))
    assert {g.placement.over for u in plain.units for g in u.groups} == {Over.DENSE}
    with registered(VECTORS):
        plan = lower(s.mesh, unit_sizes(params, units))
    for spec, u in zip(units, plan.units):
        vec = [g for g in u.groups if g.placement.over == VECTORS.over]
        phi = _vectors(model, spec.params)
        assert [g.phi for g in vec] == [phi] and vec[0].trainable and vec[0].n == phi    # replicated: no padding
        g = vec[0]
        assert g.factors == Factors(1, 1, 1, 1) and g.placement.mesh == s.mesh
        # replicated over the whole mesh: one all-reduce of the gradient per step, nothing else
        assert [(r.phase, r.op, r.levels, r.bytes, r.per, r.over) for r in g.rows] == [
            (Phase.SYNC, Op.ALL_REDUCE, ("node", "gpu"), 4 * phi, Per.STEP, VECTORS.over)]
        assert g.params_bytes == g.grads_bytes == 4 * phi and g.optim_elems == phi
        dense = next(d for d in u.groups if d.placement.over == Over.DENSE)
        assert dense.phi == sum(params[n].numel() for n in spec.params) - phi
    # the clip's all-reduce stays the dense optimizer's (a replicated group adds its squares locally)
    assert plan.clip_rows == plain.clip_rows
    # the plan, its placements included, still reads back as code
    from shardc.dsl import ir as dsl_ir
    from shardc.lowering import ir
    assert eval(repr(plan), {**vars(dsl_ir), **vars(ir)}) == plan


def _train(rank, world):
    with registered(VECTORS):
        return _train_in_scope(rank, world)


def _train_in_scope(rank, world):
    from shardc.runtime import shard_module
    s = shardc.load_strategy(ZERO3)
    acc, data, model = s.accumulate, batches(2, world, s.accumulate), Tiny()
    want, norms = reference(model, data, "adamw", clip=CLIP)
    sm = shard_module(copy.deepcopy(model), s, _units(model, s))
    opt = sm.optimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    got_norms = []
    sm.reset_comm_ledger()
    for x, y in data:
        xs, ys = x.chunk(world)[rank].chunk(acc), y.chunk(world)[rank].chunk(acc)
        for m in range(acc):
            (loss_fn(sm(xs[m]), ys[m]) / acc).backward()
        got_norms.append(float(sm.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
    overs = sorted({g.placement.over.value for u in sm.lowering.units for g in u.groups})
    with pytest.raises(shardc.ShardcError, match="does not take the placement kind 'vectors' yet"):
        shard_module(copy.deepcopy(model), s, _units(model, s), backend="inductor")
    return max_rel_err(sm.full_state_dict(), want), norms, got_norms, sm.comm_ledger(), overs


def test_a_registered_kind_trains_at_parity_and_its_ledger_is_the_plans():
    from shardc.analysis.costmodel.ledger import ledger_of
    results = dist_run(WORLD, _train)
    s, model = shardc.load_strategy(ZERO3), Tiny()
    with registered(VECTORS):
        plan = lower(s.mesh, unit_sizes(dict(model.named_parameters()), _units(model, s)))
        one_step = ledger_of(plan, forwards=s.accumulate, backwards=s.accumulate, clips=1)
    for err, norms, got_norms, ledger, overs in results:
        assert err < 1e-5
        assert got_norms == pytest.approx(norms, rel=1e-5)
        assert overs == ["dense", "vectors"]
        assert ledger == [type(r)(r.phase, r.op, r.levels, r.bytes, 2 * r.count, r.over) for r in one_step]
        assert any(r.over == "vectors" for r in ledger)


# The experts are a kind like `vectors`: their value is named only where kinds are defined or
# listed, never by a stage that consumes a plan (lowering/placements.py [Note: placement kinds]).
NAMES_A_KIND = {
    "lowering/ir.py": "defines the value",
    "lowering/experts.py": "the experts' kind",
    "runtime/transport/experts.py": "the experts' runtime",
    "lowering/placements.py": "the language's kinds, in ledger order",
    "lowering/scopes.py": "kinds_of: the kinds a strategy's statements make",
    "shardc/simulate.py": "a simulated rank hands a MoE factory its ep mesh",
    "runtime/groups/placed.py": "OWN_MESH: the kinds on a mesh of their own and their runtimes",
    "analysis/costmodel/report.py": "explain --json's `expert_params` field",
    "shardc/cli/cmd_explain.py": "explain's `N of them experts` line",
}


def test_no_stage_branches_on_the_experts_kind():
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    found = set()
    for d in ("lowering", "runtime", "analysis", "compiler", "units", "shardc"):
        for path in (root / d).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "EXPERTS" or \
                        isinstance(node, ast.Name) and node.id in ("ExpertGroup", "is_expert", "expert_group"):
                    found.add(path.relative_to(root).as_posix())
    assert found - set(NAMES_A_KIND) == set()
    # the experts' kind says what the stages used to branch on
    s = shardc.load_strategy('mesh node(2) > gpu(4)\nparams shard over node\ngrads shard over node\n'
                             'optim shard over node\nexperts "*.experts" ep 2\n')
    from shardc.lowering import kinds_of
    (e,) = kinds_of(s)
    assert e.over == Over.EXPERTS and e.parts == 2 and e.takes("blocks.0.moe.experts.w1", None)
    pl = e.placement(s.mesh, s.scopes)
    assert pl.mesh == s.expert_mesh and pl.scopes == s.expert_scopes
    # optim over node leaves out gpu, the level ep borrows from: the clip is over node, gpu
    # and meets each expert slice gpu / ep = 2 times
    assert pl.clip_levels == ("node", "gpu") and pl.clip_weight == 4 // 2
    assert e.local_shape("w", (8, 3)) == (4, 3)
    with pytest.raises(shardc.ShardcError, match="ep 2 must divide its dim 0"):
        e.local_shape("w", (3, 3))
