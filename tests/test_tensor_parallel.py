"""shardc inside a bigger DeviceMesh: tensor parallelism and DTensor parameters.

8 gloo ranks as a (node 2, gpu 2, tp 2) DeviceMesh. The example GPT gets torch's own TP
(`examples/gpt.py` `tensor_parallel`: `parallelize_module` with ColwiseParallel and
RowwiseParallel, heads and hidden units split over tp), then `shardc.compile(model,
FILE, mesh=world_mesh["node", "gpu"])` with the shipped strategy files unchanged:
- parity with one process on the concatenated batch of the 4 data-parallel ranks, for
  ZeRO-3, PaRO-NIG and hpZ (SHARDC_FULL_SWEEPS=1: ZeRO-1, PaRO-IIG and MiCS too), with
  AdamW and with SGD + momentum,
  `clip_grad_norm_` and 2 micro-batches; and RMSprop with a param group by name (TP-split
  weights and replicated norms at their own learning rate);
- the measured ledger and memory equal `shardc explain --tp 2` (real strategy text
  through the CLI), byte for byte;
- DCP checkpoints: dp x tp -> dp only (node 2, gpu 4) -> dp x tp, equal to an
  uninterrupted run with AdamW state;
- each bad input (a level the DeviceMesh lacks, a size that differs, a mesh of another
  device type, a DTensor over a data-parallel dim, a root dim nobody averages over) gets
  one sentence naming both sides.
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.harness import FULL_SWEEPS, dist_run, failure

pytestmark = pytest.mark.distributed
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRAT = os.path.join(ROOT, "examples", "strategies")
HPZ = "mesh node(*) > gpu(local)\nparams shard over world secondary gpu\ngrads shard over world\noptim shard over world\n"
# three of the six on 2 cores (params sharded over the world, params whole with grads over gpu,
# an hpZ secondary); SHARDC_FULL_SWEEPS=1 runs all six
CASES = ["zero3", "zero1", "paro_iig", "paro_nig", "mics", "hpz"] if FULL_SWEEPS else ["zero3", "paro_nig", "hpz"]
DP, STEPS, B, ACC, CLIP = 4, 2, 2, 2, 0.05


def cfg():
    from examples.gpt import GPTConfig
    return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def gpt():
    from examples.gpt import GPT
    torch.manual_seed(0)
    return GPT(cfg())


def data(steps=STEPS, offset=0):
    g = torch.Generator().manual_seed(1)
    c = cfg()
    out = [[torch.randint(0, c.vocab_size, (2, DP * B, c.block_size), generator=g) for _ in range(ACC)]
           for _ in range(offset + steps)]
    return out[offset:]


def opt_of(kind):
    return (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)) if kind == "adamw" else \
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9))


def train(model, opt, steps, dp_index=None, clip=CLIP, parts=DP):
    """`steps` on data-parallel rank `dp_index` of `parts` (None: one process, whole batch)."""
    for step in steps:
        for x, y in step:
            if dp_index is not None:
                x, y = x.chunk(parts)[dp_index], y.chunk(parts)[dp_index]
            (F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / ACC).backward()
        if hasattr(model, "clip_grad_norm_"):
            model.clip_grad_norm_(clip)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def reference(kind, steps=STEPS):
    model = gpt()
    cls, kw = opt_of(kind)
    opt = cls(model.parameters(), **kw)
    train(model, opt, data(steps))
    return model, opt


def rel(got: dict, want: dict) -> float:
    return max(float((got[k] - v).norm() / v.norm().clamp_min(1e-12)) for k, v in want.items())


def world_mesh(shape=(2, 2, 2), names=("node", "gpu", "tp")):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def sharded(strategy, wm, tp=True):
    import shardc
    from examples.gpt import tensor_parallel
    model = gpt()
    if tp:
        tensor_parallel(model, wm["tp"])
    text = HPZ if strategy == "hpz" else os.path.join(STRAT, strategy + ".shard")
    dp = wm["node", "gpu"] if tp else wm
    return shardc.compile(model, text, mesh=dp, example_inputs=(torch.zeros(2, cfg().block_size, dtype=torch.long),))


def _parity(rank, world):
    wm = world_mesh()
    dp_index = rank // 2
    out = {}
    for strategy in CASES:
        for kind in ("adamw", "sgd"):
            sm = sharded(strategy, wm)
            cls, kw = opt_of(kind)
            opt = sm.optimizer(cls, **kw)
            train(sm, opt, data(STEPS - 1), dp_index)
            sm.reset_comm_ledger()
            train(sm, opt, data(1, STEPS - 1), dp_index)       # the last step's ledger
            if strategy == "zero3" and kind == "adamw":
                out["ledger"] = [(r.phase, r.op, list(r.levels), r.bytes, r.count) for r in sm.comm_ledger()]
                out["memory"] = dict(sm.memory_report())
            want, _ = reference(kind)
            out[strategy, kind] = rel(sm.full_state_dict(), want.state_dict())
    # param groups by name: TP-split weights and replicated norms at their own learning rate
    sm = sharded("paro_iig", wm)
    opt = sm.optimizer(torch.optim.RMSprop, param_groups=[dict(params=FAST, lr=3e-3)],
                       lr=1e-3, weight_decay=0.1, momentum=0.9)
    train(sm, opt, data(), dp_index)
    model = gpt()
    named = dict(model.named_parameters())
    ref = torch.optim.RMSprop([dict(params=[named[n] for n in FAST], lr=3e-3),
                               dict(params=[p for n, p in named.items() if n not in FAST])],
                              lr=1e-3, weight_decay=0.1, momentum=0.9)
    train(model, ref, data())
    out["groups"] = rel(sm.full_state_dict(), model.state_dict())
    return out


FAST = [f"transformer.h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "mlp.c_proj", "ln_1")]


def test_strategies_train_at_parity_on_a_dp_by_tp_mesh():
    results = dist_run(8, _parity)
    for r in results:
        for strategy in CASES:
            for kind in ("adamw", "sgd"):
                assert r[strategy, kind] < 1e-5, (strategy, kind, r[strategy, kind])
        assert r["groups"] < 1e-5, r["groups"]
    # the ledger counts shardc's collectives (the dp mesh's), not DTensor's; explain --tp 2
    # assumes the same plan on the same real strategy text
    cmd = [sys.executable, "-m", "shardc.cli", "explain", os.path.join(STRAT, "zero3.shard"), "--model",
           "examples/gpt.py:tiny", "--mesh", "node(2) > gpu(2)", "--tp", "2", "--micro-batches", str(ACC),
           "--clip", "--json", "--no-graph"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    predicted = json.loads(run.stdout)
    ledger = [(d["phase"], d["op"], d["levels"], d["bytes"], d["count"]) for d in predicted["ledger"]]
    for r in results:
        assert r["ledger"] == ledger
        assert {k: r["memory"][k] for k in ("params", "grads", "optim", "total")} == \
            {k: predicted["memory"][k] for k in ("params", "grads", "optim", "total")}
    # a TP block's collectives carry its local shard: 6,400 elements, not 12,608
    assert ("forward", "all_gather", ["node", "gpu"], 6400 * 4, 2 * ACC) in ledger


def _checkpoints(rank, world, root):
    from tests.test_checkpoint_interop import load, save          # the README's recipe

    tp_mesh, flat = world_mesh(), world_mesh((2, 4), ("node", "gpu"))
    out = {}
    # dp x tp -> dp only
    sm = sharded("paro_iig", tp_mesh)
    opt = sm.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    train(sm, opt, data(1), rank // 2)
    save(sm, opt, f"{root}/tp")
    out["keys"] = sorted(sm.state_dict())
    other = sharded("zero3", flat, tp=False)
    oopt = other.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    load(other, oopt, f"{root}/tp")
    train(other, oopt, data(1, 1), rank, parts=8)                  # 8 data-parallel ranks now
    out["tp_to_dp"] = (other.full_state_dict(), other.full_optim_state_dict(oopt)["state"])
    # dp only -> dp x tp
    save(other, oopt, f"{root}/dp")
    back = sharded("mics", tp_mesh)
    bopt = back.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    load(back, bopt, f"{root}/dp")
    train(back, bopt, data(1, 2), rank // 2)
    out["dp_to_tp"] = (back.full_state_dict(), back.full_optim_state_dict(bopt)["state"])
    return out


def _state_of(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: st for p, st in opt.state.items()}


def test_checkpoints_move_between_dp_by_tp_and_dp_only_layouts(tmp_path):
    results = dist_run(8, _checkpoints, str(tmp_path))
    expect = {}
    for steps in (2, 3):
        model, opt = reference("adamw", steps)
        expect[steps] = (model.state_dict(), _state_of(model, opt))
    for r in results:
        assert r["keys"] == sorted(gpt().state_dict())                   # global names, global shapes
        for label, steps in (("tp_to_dp", 2), ("dp_to_tp", 3)):
            params, state = r[label]
            want, want_state = expect[steps]
            assert rel(params, want) < 1e-5, (label, rel(params, want))
            for name, st in want_state.items():
                for k in ("exp_avg", "exp_avg_sq"):
                    assert rel({k: state[name][k]}, {k: st[k]}) < 1e-5, (label, name, k)


def _bad(rank, world):
    import shardc
    from examples.gpt import tensor_parallel
    wm = world_mesh()
    x = (torch.zeros(2, cfg().block_size, dtype=torch.long),)
    out = {}

    def attempt(label, fn):
        out[label] = failure(fn)

    paro = os.path.join(STRAT, "paro_iig.shard")
    attempt("lacks", lambda: shardc.compile(tensor_parallel(gpt(), wm["gpu"]), paro, mesh=wm["node", "tp"],
                                            example_inputs=x))
    attempt("size", lambda: shardc.compile(tensor_parallel(gpt(), wm["tp"]), "mesh node(2) > gpu(4)\n"
                                           "params shard over world\ngrads shard over world\noptim shard over world\n",
                                           mesh=wm["node", "gpu"], example_inputs=x))
    attempt("dp_dim", lambda: shardc.compile(tensor_parallel(gpt(), wm["gpu"]), paro, mesh=wm["node", "gpu"],
                                             example_inputs=x))
    attempt("unused_dim", lambda: shardc.compile(gpt(), paro, mesh=wm["node", "gpu"], example_inputs=x))
    return out


def test_bad_meshes_get_one_sentence_naming_both_sides():
    for out in dist_run(8, _bad):
        assert "level `gpu` is not a dim of the DeviceMesh, whose dims are node=2, tp=2" in out["lacks"], out
        assert "level `gpu` has size 4 here, but the DeviceMesh's dim `gpu` has 2" in out["size"], out
        assert "'transformer.h.0.attn.c_attn.weight' is a DTensor over dim 'gpu'" in out["dp_dim"], out
        assert "with dim 'tp', which is neither one of the strategy's levels" in out["unused_dim"], out
        for msg in out.values():
            assert "Traceback" not in msg and msg.startswith(("StrategyError", "ShardcError")), msg


def test_a_mesh_of_another_device_type_is_refused():
    from types import SimpleNamespace

    from shardc.dsl import parse_mesh_text
    from shardc.runtime.transport.mesh import check_device_mesh
    mesh = parse_mesh_text("node(2) > gpu(2)")
    dm = SimpleNamespace(mesh_dim_names=("node", "gpu"), mesh=torch.arange(4).reshape(2, 2), device_type="cuda")
    with pytest.raises(Exception, match="the DeviceMesh is a cuda mesh but the model's parameters are on cpu"):
        check_device_mesh(mesh, dm, "cpu")
    dm.mesh_dim_names = ("node", "tp")
    with pytest.raises(Exception, match="the DeviceMesh's dims are node, tp but the strategy's mesh levels are "
                                        "node, gpu"):
        check_device_mesh(mesh, dm, "cpu")
