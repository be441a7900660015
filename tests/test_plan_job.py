"""shardc/handoff.py: capture once per job. On 2 gloo ranks an HF Llama (export capture)
is compiled on rank 0 only — rank 1's compiler is made to fail if called — and rank 1
trains on the plan it received, equal to one process on the concatenated batch (rel
1e-5). With $SHARDC_PLAN_CACHE a second compile of the same job compiles nothing on any
rank (rank 0 reads the cache). A rank whose model differs, and a compile that fails on
rank 0, are one sentence on every rank, not a hang."""
import pytest
import torch

import shardc
from shardc import handoff
from tests.harness import dist_run
from tests.test_hf_models import B, T, make_model, opt_kwargs, train

pytestmark = pytest.mark.distributed
WORLD = 2
STRATEGY = """strategy z3
mesh gpu(2)
params shard over gpu
grads  shard over gpu
optim  shard over gpu
"""
X = (torch.zeros(B, T, dtype=torch.long),)


def _forbid(monkeypatch_ranks, rank):
    if rank in monkeypatch_ranks:
        def refuse(*a, **k):
            raise AssertionError(f"rank {rank} compiled")
        handoff.compile_source = refuse


def _job(rank, world, cache_dir):
    real = handoff.compile_source
    try:
        _forbid({1}, rank)
        sm = shardc.compile(make_model("llama", seed=0 if rank == 0 else 7), STRATEGY, example_inputs=X)
        origins = [sm.plan_origin]
        cls, kw = opt_kwargs("sgd")
        losses = train(sm, sm.optimizer(cls, **kw), rank, world, True)
        full = {k: v.clone() for k, v in sm.full_state_dict().items()}
        import os
        os.environ[handoff.CACHE_ENV] = cache_dir
        origins.append(shardc.compile(make_model("llama"), STRATEGY, example_inputs=X).plan_origin)
        _forbid({0, 1}, rank)                           # the cache holds it now: nobody compiles
        sm2 = shardc.compile(make_model("llama"), STRATEGY, example_inputs=X)
        origins.append(sm2.plan_origin)
        del os.environ[handoff.CACHE_ENV]
        handoff.compile_source = real
        errors = []
        other = make_model("gpt2") if rank == 1 else make_model("llama")          # rank 1 differs
        try:
            shardc.compile(other, STRATEGY, example_inputs=X)
        except shardc.ShardcError as e:
            errors.append(str(e))
        try:
            shardc.compile(make_model("llama"), STRATEGY.replace("gpu(2)", "gpu(3)"), example_inputs=X)
        except shardc.ShardcError as e:
            errors.append(str(e))
        return origins, losses, full, sm2.plan == sm.plan, errors
    finally:
        handoff.compile_source = real


def test_rank_zero_compiles_the_others_receive(tmp_path):
    results = dist_run(WORLD, _job, str(tmp_path))
    assert [r[0] for r in results] == [["compiled", "compiled", "cache"], ["received"] * 3]
    assert all(r[3] for r in results)
    model = make_model("llama")
    cls, kw = opt_kwargs("sgd")
    ref = train(model, cls(model.parameters(), **kw), 0, WORLD, False)
    mean = torch.tensor([r[1] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref), rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        for r in results:
            rel = float((r[2][name] - p.detach()).norm() / p.detach().norm())
            assert rel <= 1e-5, f"{name}: relative error {rel:.3g}"
    for _, _, _, _, errors in results:
        assert len(errors) == 2
        assert errors[0].startswith("rank 1's model, strategy, mesh or example inputs differ from rank 0's")
    own, told = results[0][4][1], results[1][4][1]         # the mesh of 3 on a world of 2
    assert told == f"rank 0 could not compile the model, so no rank has a plan: {own}"
