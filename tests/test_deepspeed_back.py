"""A shardc checkpoint goes back to DeepSpeed (shardc.deepspeed_universal, docs/deepspeed.md):
shardc trains the tiny model K steps under ZeRO-3 on 2 gloo ranks with torch's AdamW, saves a
DCP checkpoint through torch's recipe and takes one more step. `dcp_to_deepspeed` writes the
checkpoint as a DeepSpeed universal checkpoint; DeepSpeed 0.19.8 ZeRO-3, and ZeRO-2, on 4 ranks loads it
(`"checkpoint": {"load_universal": true}`) and takes the same step on the same 8 samples: the
step's loss and every parameter afterwards equal shardc's to float32 rounding, which needs
AdamW's exp_avg, exp_avg_sq and step across (the step sets Adam's bias correction), and the
loaded moments equal shardc's saved ones. A checkpoint of the model alone (no optimizer) is
one sentence. Skips without DeepSpeed (an optional dependency)."""
from __future__ import annotations

import os

import pytest
import torch

from tests.harness import dist_run

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]'); "
                    "this test loads shardc's checkpoint into DeepSpeed")
from tests.test_deepspeed_checkpoint import K, _data, _model  # noqa: E402  (after the skip)
pytestmark = pytest.mark.distributed


def _shardc(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardc.runtime import shard_module
    from tests.test_runtime_util import loss_fn, make_opt, strategy, units_for
    s = strategy("zero3", "node(1) > gpu(2)", accumulate=1)
    m = _model()
    sm = shard_module(m, s, units_for(m, s.scopes))
    opt = make_opt("adamw", sm)
    data = _data()

    def step(x, y):
        loss = loss_fn(sm(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    msd, osd = get_state_dict(sm, opt)
    dcp.save({"model": msd}, checkpoint_id=path + "-model")       # the model alone
    for x, y in data[:K]:
        step(x, y)
    msd, osd = get_state_dict(sm, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = sm.full_optim_state_dict(opt)["state"]
    loss = step(*data[K])
    return loss, sm.full_state_dict(), saved


def _ds(rank, world, path, stage):
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    from deepspeed.utils import safe_get_full_optimizer_state

    from tests.test_runtime_util import loss_fn
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": 8 // world, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True, "checkpoint": {"load_universal": True}}
    m = _model(seed=5)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
    eng = deepspeed.initialize(model=m, optimizer=opt, config=cfg)[0]
    eng.load_checkpoint(path)
    moments = {n: {k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}
               for n, p in eng.module.named_parameters()}
    x, y = _data()[K]
    loss = loss_fn(eng(x.chunk(world)[rank]), y.chunk(world)[rank])
    eng.backward(loss)
    eng.step()
    with deepspeed.zero.GatheredParameters(list(eng.module.parameters())):
        after = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    return loss.item(), after, moments


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """shardc's run: the DCP checkpoint after K steps, the next step's loss and parameters,
    the saved moments, and the checkpoint as a universal one."""
    from shardc.deepspeed_universal import dcp_to_deepspeed
    tmp = tmp_path_factory.mktemp("back")
    path = str(tmp / "shardc")
    got = dist_run(2, _shardc, path)
    names = dcp_to_deepspeed(path, str(tmp / "ds"))
    return dict(path=path, ds=str(tmp / "ds"), names=names, loss=_mean([r[0] for r in got]),
                after=got[0][1], moments=got[0][2])


@pytest.mark.parametrize("stage", [3, 2])
def test_shardc_checkpoint_resumes_under_deepspeed(saved, stage):
    names, loss, after = saved["names"], saved["loss"], saved["after"]
    assert set(names) == {n for n, _ in _model().named_parameters()}
    ds = dist_run(4, _ds, saved["ds"], stage)
    ds_loss, ds_after, moments = _mean([r[0] for r in ds]), ds[0][1], ds[0][2]
    for n in names:                                   # what DeepSpeed loaded is what shardc saved
        for k in ("exp_avg", "exp_avg_sq"):
            want = saved["moments"][n][k]
            torch.testing.assert_close(moments[n][k].reshape(want.shape), want, rtol=0, atol=0,
                                       msg=f"{n}.{k}")
    err = max((after[n] - ds_after[n]).abs().max().item() for n in ds_after)
    print(f"shardc zero3 on 2 -> DeepSpeed ZeRO-{stage} on 4: loss {ds_loss:.7f} vs shardc {loss:.7f}, "
          f"max abs parameter difference {err:.2e}")
    assert abs(loss - ds_loss) <= 1e-5 * abs(loss), (ds_loss, loss)
    for n in ds_after:
        torch.testing.assert_close(ds_after[n], after[n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_model_alone_is_one_sentence(saved, tmp_path):
    import shardc
    from shardc.deepspeed_universal import dcp_to_deepspeed
    with pytest.raises(shardc.ShardcError, match="has no optimizer param groups") as e:
        dcp_to_deepspeed(saved["path"] + "-model", str(tmp_path / "ds-model"))
    assert "\n" not in str(e.value)
