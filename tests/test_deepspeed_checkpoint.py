"""A DeepSpeed ZeRO checkpoint resumes under shardc (shardc.deepspeed, docs/deepspeed.md).

DeepSpeed trains the tiny model K steps on 4 gloo ranks with torch's AdamW and saves
(`engine.save_checkpoint`); DeepSpeed's own resume (`engine.load_checkpoint` in a fresh
engine) then takes one more step. shardc loads the same directory (`shardc.load_deepspeed`:
DeepSpeed's ds_to_universal, then DCP) under another strategy and world size and takes the
same step on the same 8 samples: AdamW's exp_avg, exp_avg_sq and step count as loaded equal
DeepSpeed's resumed ones exactly, and the step's loss and every parameter afterwards equal
DeepSpeed's to float32 rounding. ZeRO-3 of 4 ranks -> PaRO-IIG on 8; ZeRO-2 of 4 -> ZeRO-3
on 2. Bad input is one sentence each. DeepSpeed is an optional dependency (the
`deepspeed` extra, not `test`): without it the module skips, saying so.
"""
from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from tests.harness import dist_run

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]'); "
                    "these tests resume DeepSpeed's own checkpoints")
pytestmark = pytest.mark.distributed
K = 2                                   # DeepSpeed steps before the save
CLIP = 1.0                              # DeepSpeed's default gradient_clipping (0.19.8), set explicitly


def _model(seed=0, d=None):
    from torch import nn

    from tests.test_runtime_util import D, Tiny
    m = Tiny(seed=seed, d=d or D)
    m.head.weight = nn.Parameter(m.emb.weight.detach().clone())   # untied: see docs/deepspeed.md
    return m


def _data():
    from tests.test_runtime_util import batches
    return batches(K + 1, 4, 1, b=2)    # 8 samples a step, whatever the world size


def _ds(rank, world, stage, path):
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    from tests.test_runtime_util import loss_fn
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": 8 // world, "gradient_accumulation_steps": 1,
           "gradient_clipping": CLIP,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}

    def engine():
        m = _model()
        opt = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
        return deepspeed.initialize(model=m, optimizer=opt, config=cfg)[0]

    def step(eng, x, y):
        loss = loss_fn(eng(x.chunk(world)[rank]), y.chunk(world)[rank])
        eng.backward(loss)
        eng.step()
        return loss.item()

    data = _data()
    eng = engine()
    for x, y in data[:K]:
        step(eng, x, y)
    eng.save_checkpoint(path)
    resumed = engine()
    resumed.load_checkpoint(path)
    from deepspeed.utils import safe_get_full_optimizer_state
    if hasattr(resumed.optimizer, "_lazy_init_hp_params_optimizer_state"):   # ZeRO-1/2 link them at step
        resumed.optimizer._lazy_init_hp_params_optimizer_state()
    loaded = {n: {k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}
              for n, p in resumed.module.named_parameters()}
    steps = {float(st["step"]) for st in resumed.optimizer.optimizer.state.values() if "step" in st}
    loss = step(resumed, *data[K])
    params = list(resumed.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        after = {n: p.detach().clone() for n, p in resumed.module.named_parameters()}
    return loss, after, loaded, steps


def _shardc(rank, world, name, mesh, path, work):
    import shardc
    from shardc.runtime import shard_module
    from tests.test_runtime_util import loss_fn, make_opt, strategy, units_for
    s = strategy(name, mesh, accumulate=1)
    m = _model(seed=5)
    sm = shard_module(m, s, units_for(m, s.scopes))
    opt = make_opt("adamw", sm)
    shardc.load_deepspeed(sm, opt, path, work_dir=work)
    loaded = sm.full_optim_state_dict(opt)["state"]
    x, y = _data()[K]
    loss = loss_fn(sm(x.chunk(world)[rank]), y.chunk(world)[rank])
    loss.backward()
    sm.clip_grad_norm_(CLIP)
    opt.step()
    opt.zero_grad()
    # a model of another width: the first mismatched parameter, one sentence
    w = _model(seed=5, d=8)
    wm = shard_module(w, s, units_for(w, s.scopes))
    try:
        shardc.load_deepspeed(wm, make_opt("adamw", wm), path, work_dir=work + "-w")
        wrong = None
    except shardc.ShardcError as e:
        wrong = str(e)
    return loss.item(), sm.full_state_dict(), wrong, loaded


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.parametrize("stage,name,world,mesh", [(3, "paro_iig", 8, "node(2) > gpu(4)"),
                                                   (2, "zero3", 2, "node(1) > gpu(2)")])
def test_deepspeed_checkpoint_resumes_under_shardc(tmp_path, stage, name, world, mesh):
    path = str(tmp_path / f"ds_zero{stage}")
    ds = dist_run(4, _ds, stage, path)
    ds_loss, ds_after = _mean([r[0] for r in ds]), ds[0][1]
    got = dist_run(world, _shardc, name, mesh, path, str(tmp_path / "dcp"))
    loss, after, wrong = _mean([r[0] for r in got]), got[0][1], got[0][2]
    # what shardc loaded is what DeepSpeed's own resume holds: AdamW's moments and step count
    ds_loaded, ds_steps, loaded = ds[0][2], ds[0][3], got[0][3]
    assert ds_steps == {float(K)}, ds_steps
    for n, want in ds_loaded.items():
        assert float(loaded[n]["step"]) == K, (n, loaded[n]["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(loaded[n][k], want[k].reshape(loaded[n][k].shape), rtol=0, atol=0,
                                       msg=f"{n}.{k}")
    assert abs(loss - ds_loss) <= 1e-5 * abs(ds_loss), (loss, ds_loss)
    assert set(ds_after) <= set(after)          # shardc's also holds the buffer
    err = max((after[n] - ds_after[n]).abs().max().item() for n in ds_after)
    print(f"ZeRO-{stage} -> {name} on {world}: loss {loss:.7f} vs DeepSpeed {ds_loss:.7f}, "
          f"max abs parameter difference {err:.2e}")
    for n in ds_after:
        torch.testing.assert_close(after[n], ds_after[n], rtol=1e-5, atol=1e-6, msg=n)
    assert wrong and "\n" not in wrong and "shape" in wrong and "emb.weight" in wrong, wrong
    # bad directories, one sentence each (one process: the conversion needs no group)
    import shardc
    from shardc.deepspeed import deepspeed_to_dcp
    tag = open(os.path.join(path, "latest")).read().strip()
    no_model = tmp_path / "no_model"
    shutil.copytree(os.path.join(path, tag), no_model)
    for f in glob.glob(str(no_model / "*model_states.pt")):
        os.remove(f)
    with pytest.raises(shardc.ShardcError, match="has no mp_rank_.*_model_states.pt files") as e:
        deepspeed_to_dcp(str(no_model), str(tmp_path / "x"))
    assert "\n" not in str(e.value)
    if stage == 3:        # one rank's model-state file gone: stage 3 needs one per rank
        one_gone = tmp_path / "one_gone"
        shutil.copytree(os.path.join(path, tag), one_gone)
        os.remove(sorted(glob.glob(str(one_gone / "*model_states.pt")))[-1])
        with pytest.raises(shardc.ShardcError, match="holds 4 optimizer partitions but 3 "
                           "zero_pp_rank_.*_mp_rank_.*_model_states.pt files") as e:
            deepspeed_to_dcp(str(one_gone), str(tmp_path / "z"))
        assert "\n" not in str(e.value)
    short = tmp_path / "short"
    shutil.copytree(os.path.join(path, tag), short)
    os.remove(sorted(glob.glob(str(short / "*_optim_states.pt")))[-1])
    with pytest.raises(shardc.ShardcError, match="saved by 4 ranks but holds 3") as e:
        deepspeed_to_dcp(str(short), str(tmp_path / "y"))
    assert "\n" not in str(e.value)
