"""Expert parallelism in the runtime: experts placed Shard(0) on an `ep` dim borrowed from
the data-parallel ranks (examples/moe.py's ExpertParallel, torchtitan's layout: the world
mesh unflattened into (node, gpu) for shardc and (efsdp, ep) for the experts), sharded by
the strategy's `experts` statement over the ranks ep leaves.

On 8 gloo ranks, node(2) > gpu(4), ep 2 and ep = the whole gpu level: training equals one
process on the concatenated batch (SGD with momentum and AdamW, 2 micro-batches,
clip_grad_norm_) for ZeRO-3, PaRO-IIG and hpZ; the measured ledger and memory equal
`explain`'s (the experts' records apart); every bad placement is one sentence.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from shardc.lowering import Over
from tests.harness import dist_run

pytestmark = pytest.mark.distributed
MOE = "examples/strategies/moe/"
IIG_EP2 = """mesh node(2) > gpu(4)
params shard over gpu
grads  shard over gpu
optim  shard over world
accumulate 2
experts "*.experts" ep 2
"""
HPZ_EP_GPU = """mesh node(2) > gpu(4)
params shard over world secondary gpu
grads  shard over world
optim  shard over world
experts "*.experts" ep gpu
"""
# (strategy file or text, ep, optimizer)
CASES = [(MOE + "ep2_zero3.shard", 2, "sgd"), (MOE + "ep_zero3.shard", 4, "adamw"),
         (IIG_EP2, 2, "adamw"), (MOE + "paro_iig_ep_zero1.shard", 4, "sgd"),
         (MOE + "hpz_ep2.shard", 2, "sgd"), (HPZ_EP_GPU, 4, "adamw")]


def _opt(kind):
    return (torch.optim.SGD, dict(lr=0.1, momentum=0.9)) if kind == "sgd" else \
        (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))


def _strategy(src):
    import shardc
    return dataclasses.replace(shardc.load_strategy(src, mesh="node(2) > gpu(4)"), accumulate=2)


def batches(rank, steps=2, micro=2):
    g = torch.Generator().manual_seed(100 + rank)
    return [[torch.randint(0, 128, (2, 8), generator=g) for _ in range(micro)] for _ in range(steps)]


def train(m, opt, steps, clip):
    losses = []
    for micro in steps:
        total = 0.0
        for x in micro:
            loss = torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()) / len(micro)
            loss.backward()
            total += float(loss.detach())
        clip(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def meshes(ep):
    from torch.distributed.device_mesh import init_device_mesh
    world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
    return world._unflatten(0, (2, 4), ("node", "gpu")), world._unflatten(0, (8 // ep, ep), ("efsdp", "ep"))["ep"]


def ep_model(ep):
    from examples.moe import apply_ep, moe_tiny
    dp, ep_mesh = meshes(ep)
    return apply_ep(moe_tiny(), ep_mesh), dp


def _job(rank, world):
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.runtime import shard_module
    from shardc.units import find_units
    out = []
    for src, ep, kind in CASES:
        s = _strategy(src)
        m, dp = ep_model(ep)
        sm = shard_module(m, s, find_units(m, resolve_bucket(m, s)), mesh=dp)
        cls, kw = _opt(kind)
        losses = train(sm, sm.optimizer(cls, **kw), batches(rank), sm.clip_grad_norm_)
        out.append((losses, sm.full_state_dict(), list(sm.comm_ledger()), dict(sm.memory_report())))
    return out


def reference(kind, world=8):
    from examples.moe import moe_tiny
    m = moe_tiny()
    per = [batches(r) for r in range(world)]
    steps = [[torch.cat([per[r][s][k] for r in range(world)]) for k in range(2)] for s in range(2)]
    cls, kw = _opt(kind)
    losses = train(m, cls(m.parameters(), **kw), steps, lambda n: torch.nn.utils.clip_grad_norm_(m.parameters(), n))
    return losses, {k: v.detach() for k, v in m.state_dict().items()}


def test_experts_on_an_ep_dim_train_at_parity_and_the_ledger_is_explains():
    from examples.moe import moe_tiny
    from shardc.analysis.costmodel import predict_ledger, predict_memory
    from shardc.analysis.costmodel.report import model_units
    results = dist_run(8, _job)
    for c, (src, ep, kind) in enumerate(CASES):
        losses, params = reference(kind)
        torch.testing.assert_close(torch.tensor([r[c][0] for r in results]).mean(0), torch.tensor(losses),
                                   rtol=1e-5, atol=1e-6)
        for rank in results:
            sd = rank[c][1]
            for k, v in params.items():
                assert float((sd[k] - v).norm() / v.norm()) < 1e-5, (src, k)
        s = _strategy(src)
        with torch.device("meta"):
            units = model_units(s, moe_tiny())
        predicted = [dataclasses.replace(r, count=2 * r.count)                    # two steps
                     for r in predict_ledger(s, units, micro_batches=2, clip_grad_norm=True)]
        ledger, memory = results[0][c][2], results[0][c][3]
        assert ledger == predicted and any(r.over == "experts" for r in ledger), src
        p_mem = predict_memory(s.mesh, units, optimizer="adamw" if kind == "adamw" else "sgd",
                               optimizer_kwargs={} if kind == "adamw" else {"momentum": 0.9})
        keys = ("params", "params_secondary", "grads", "optim", "total")
        assert {k: p_mem[k] for k in keys} == {k: memory[k] for k in keys}, src


EP2_4 = 'mesh node(2) > gpu(2)\nparams shard over world\ngrads shard over world\noptim shard over world\n' \
        'experts "*.experts" ep 2\n'


def _bad_job(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from examples.moe import apply_ep, moe_tiny
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.dsl.errors import ShardcError
    from shardc.runtime import shard_module
    from shardc.units import find_units
    import shardc
    s = shardc.load_strategy(EP2_4)
    w = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    dp = w._unflatten(0, (2, 2), ("node", "gpu"))
    ep_meshes = {"across nodes": w._unflatten(0, (2, 2), ("ep", "other"))["ep"],       # ranks [0, 2]: not gpu's
                 "plain": None}
    out = {}
    for what, mesh in ep_meshes.items():
        m = moe_tiny() if mesh is None else apply_ep(moe_tiny(), mesh)
        try:
            shard_module(m, s, find_units(m, resolve_bucket(m, s)), mesh=dp)
            out[what] = None
        except ShardcError as e:
            out[what] = str(e)
    return out


def test_experts_placed_on_other_ranks_or_not_placed_are_one_sentence_each():
    errors = dist_run(4, _bad_job)[0]
    assert errors["across nodes"] == (
        "expert parameter 'layers.0.moe.experts.w1' is a DTensor on mesh ('ep',) over ranks [0, 2], but with `ep 2` "
        "the experts of this rank's ep group live on ranks [0, 1] (the innermost ranks of level `gpu`); build the ep "
        "dim from the data-parallel ranks, innermost and contiguous (torchtitan's order), or change `ep` to match it")
    assert errors["plain"].startswith("expert parameter 'layers.0.moe.experts.w1' is a plain tensor, but with `ep 2` "
                                      "the experts of this rank's ep group live on ranks [0, 1]")


def test_an_expert_scope_over_the_ranks_ep_takes_is_a_located_error():
    import shardc
    from shardc.dsl import StrategyError
    with pytest.raises(StrategyError) as e:
        shardc.load_strategy(EP2_4.replace("ep 2", 'ep gpu {\n    optim shard over gpu\n}'))
    assert "a scope cannot include the ep ranks twice" in str(e.value) and ":6:" in str(e.value)


# -- checkpoints across ep degrees --------------------------------------------------------------
def _layout(ep):
    """gpu(4): ep 2 (two ep groups), ep gpu (one), or no ep; each a strategy and its model."""
    import shardc
    from torch.distributed.device_mesh import init_device_mesh

    from examples.moe import apply_ep, moe_tiny
    base = "mesh gpu(4)\nparams shard over world\ngrads shard over world\noptim shard over world\n"
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    dp = world._unflatten(0, (4,), ("gpu",))
    torch.manual_seed(1)                        # other values than the run that saved: the load decides
    model = moe_tiny()
    if ep == 1:
        return shardc.load_strategy(base), model, dp
    ep_mesh = world._unflatten(0, (4 // ep, ep), ("efsdp", "ep"))["ep"]
    return shardc.load_strategy(base + f'experts "*.experts" ep {ep}\n'), apply_ep(model, ep_mesh), dp


def _resume_job(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.runtime import shard_module
    from shardc.units import find_units
    data = batches(rank, steps=3, micro=1)
    losses = []
    for k, ep in enumerate((2, 4, 1)):          # ep 2 -> ep 4 (the whole level) -> no ep
        s, m, dp = _layout(ep)
        sm = shard_module(m, s, find_units(m, resolve_bucket(m, s)), mesh=dp)
        opt = sm.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        if k:
            msd, osd = get_state_dict(sm, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=f"{path}/{k - 1}")
            set_state_dict(sm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        losses += train(sm, opt, data[k:k + 1], sm.clip_grad_norm_)
        msd, osd = get_state_dict(sm, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/{k}")
        last = sm.full_state_dict(), sm.full_optim_state_dict(opt)
    return losses, last


def test_a_run_resumes_across_ep_degrees_exactly(tmp_path):
    from examples.moe import moe_tiny
    results = dist_run(4, _resume_job, str(tmp_path))
    m = moe_tiny()
    per = [batches(r, steps=3, micro=1) for r in range(4)]
    steps = [[torch.cat([per[r][s][0] for r in range(4)])] for s in range(3)]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    losses = train(m, opt, steps, lambda n: torch.nn.utils.clip_grad_norm_(m.parameters(), n))
    torch.testing.assert_close(torch.tensor([r[0] for r in results]).mean(0), torch.tensor(losses),
                               rtol=1e-5, atol=1e-6)
    names = dict(m.named_parameters())
    ref_state = {n: opt.state[p] for n, p in names.items()}
    for _, (sd, osd) in results:
        for k, v in m.state_dict().items():
            assert float((sd[k] - v).norm() / v.norm()) < 1e-5, k
        for n, st in ref_state.items():                 # AdamW's moments came through both loads
            for key in ("exp_avg", "exp_avg_sq"):
                got = osd["state"][n][key]
                assert float((got - st[key]).norm() / st[key].norm()) < 1e-4, (n, key)


# -- the compiler's paths: shardc.compile and the emitted module ---------------------------------
def _compiled_job(rank, world, emitted):
    import importlib.util

    import shardc
    from torch.distributed.device_mesh import init_device_mesh

    from examples.moe import apply_ep, moe_tiny
    w = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    dp, ep = w._unflatten(0, (2, 2), ("node", "gpu")), w._unflatten(0, (2, 2), ("efsdp", "ep"))["ep"]
    out = []
    sm = shardc.compile(apply_ep(moe_tiny(), ep), EP2_4, mesh=dp, example_inputs=(batches(rank)[0][0][:, :-1],))
    out.append(train(sm, sm.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9), batches(rank, steps=1),
                     sm.clip_grad_norm_))
    spec = importlib.util.spec_from_file_location(f"emitted_ep_{rank}", emitted)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sm = mod.shard_model(apply_ep(moe_tiny(), ep), mesh=dp)
    out.append(train(sm, sm.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9), batches(rank, steps=1),
                     sm.clip_grad_norm_))
    return out, sm.full_state_dict()


def test_shardc_compile_and_the_emitted_module_take_ep(tmp_path):
    from examples.moe import moe_tiny
    from shardc.compiler.api import compile_source
    source, plan = compile_source(moe_tiny(), EP2_4, example_inputs=(torch.zeros(2, 7, dtype=torch.long),))
    # the plan is the runtime's: one ep rank's experts (E/2 of each w1, w2, w3) on node(2) > gpu(1)
    groups = [g for u in plan.lowering.units for g in u.groups if g.placement.over == Over.EXPERTS]
    assert groups and all(g.phi == 2 * 3 * 48 * 32 for g in groups)
    assert 'experts "*.experts" ep 2' in source and "Experts(pattern='*.experts'" in source
    emitted = tmp_path / "emitted_ep.py"
    emitted.write_text(source)
    results = dist_run(4, _compiled_job, str(emitted))
    m = moe_tiny()
    per = [batches(r, steps=1) for r in range(4)]          # one step each path: the plan is what differs
    steps = [[torch.cat([per[r][s][k] for r in range(4)]) for k in range(2)] for s in range(1)]
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    losses = train(m, opt, steps, lambda n: torch.nn.utils.clip_grad_norm_(m.parameters(), n))
    for path in range(2):
        torch.testing.assert_close(torch.tensor([r[0][path] for r in results]).mean(0), torch.tensor(losses),
                                   rtol=1e-5, atol=1e-6)
    for _, sd in results:
        for k, v in m.state_dict().items():
            assert float((sd[k] - v).norm() / v.norm()) < 1e-5, k
