"""Checkpoints that resume training: torch's recipe (`get_state_dict(sm, opt)`, `dcp.save`,
`dcp.load`, `set_state_dict`) on a ShardedModule and its optimizer.

Save after k steps under strategy A, load under B into a differently initialised model:
parameters and optimizer states (step counts included) equal A's at the save bit for bit,
and continuing equals a run that had not stopped (same strategy and world: bit for bit;
another strategy or world: bit for bit against B started from the same full state, and
within float rounding of one process on the concatenated batch). The blocks have 109
elements, which no shard factor divides, so every layout pads differently."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.harness import dist_run
from tests.test_runtime_util import (Tiny, batches, loss_fn, make_opt, max_rel_err, reference,
                                     strategy, units_for)

pytestmark = pytest.mark.distributed
K, MORE = 2, 2                      # steps before the save, steps after it
SAMPLES = 8                         # global batch (same data on every world size)


def _build(name, mesh, seed, kind):
    from shardc.runtime import shard_module
    model = Tiny(seed=seed)
    s = strategy(name, mesh, accumulate=1)
    sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes))
    return sm, make_opt(kind, sm)


def _train(sm, opt, data, rank, world):
    for x, y in data:
        loss_fn(sm(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()


def _data(world):
    return batches(K + MORE, world, 1, b=SAMPLES // world)


def _full(sm, opt):
    return sm.full_state_dict(), sm.full_optim_state_dict(opt)


def _save(rank, world, name, mesh, kind, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    import torch.distributed.checkpoint as dcp
    sm, opt = _build(name, mesh, 0, kind)
    data = _data(world)
    _train(sm, opt, data[:K], rank, world)
    msd, osd = get_state_dict(sm, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    at_save = _full(sm, opt)
    _train(sm, opt, data[K:], rank, world)
    return at_save, _full(sm, opt)


def _load(rank, world, name, mesh, kind, path, at_save):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp
    sm, opt = _build(name, mesh, 5, kind)
    msd, osd = get_state_dict(sm, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(sm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full(sm, opt)
    data = _data(world)
    _train(sm, opt, data[K:], rank, world)
    resumed = _full(sm, opt)
    # the same strategy started from the saved full state (no checkpoint files involved)
    other, oopt = _build(name, mesh, 7, kind)
    other.load_full_state_dict(at_save[0])
    oopt.load_state_dict(at_save[1])
    _train(other, oopt, data[K:], rank, world)
    return loaded, resumed, _full(other, oopt)


def _same(a, b, where=""):
    """Bit-for-bit equality of nested dicts/lists of tensors and scalars."""
    if isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(set(a) ^ set(b)))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and torch.equal(a, b), (where, (a - b).abs().max())
    else:
        assert a == b, (where, a, b)


def _resume(tmp_path, a, b, kind):
    (wa, na, ma), (wb, nb, mb) = a, b
    path = str(tmp_path / "ckpt")
    saved = dist_run(wa, _save, na, ma, kind, path)
    at_save, uninterrupted = saved[0]
    for r in saved[1:]:                                 # every rank agrees
        _same(r[0], at_save)
    got = dist_run(wb, _load, nb, mb, kind, path, at_save)
    for loaded, resumed, from_full in got:
        _same(loaded, at_save, "loaded")
        _same(resumed, from_full, "resumed")
    return uninterrupted, got[0][1]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_same_strategy_and_world_resumes_bit_for_bit(tmp_path, kind):
    uninterrupted, resumed = _resume(tmp_path, (4, "paro_iig", "node(2) > gpu(2)"),
                                     (4, "paro_iig", "node(2) > gpu(2)"), kind)
    _same(resumed, uninterrupted, "uninterrupted")


def test_zero3_world8_to_paro_iig_world4(tmp_path):
    uninterrupted, resumed = _resume(tmp_path, (8, "zero3", "node(2) > gpu(4)"),
                                     (4, "paro_iig", "node(2) > gpu(2)"), "adamw")
    want, _ = reference(Tiny(), _data(1), "adamw")
    assert max_rel_err(resumed[0], want) < 1e-5
    assert max_rel_err(resumed[0], uninterrupted[0]) < 1e-5


def test_three_level_mesh_to_zeropp_two_levels(tmp_path):
    _, resumed = _resume(tmp_path, (8, "zero_topo", "node(2) > gpu(2) > gcd(2)"),
                         (4, "zeropp", "node(2) > gpu(2)"), "sgd")
    want, _ = reference(Tiny(), _data(1), "sgd")
    assert max_rel_err(resumed[0], want) < 1e-5


def test_padding_differs_world4_to_world2(tmp_path):
    _, resumed = _resume(tmp_path, (4, "zero3", "node(2) > gpu(2)"), (2, "zero3", "gpu(2)"),
                         "adamw")
    want, _ = reference(Tiny(), _data(1), "adamw")
    assert max_rel_err(resumed[0], want) < 1e-5


# -- whole-model export ----------------------------------------------------------------------
def _export(rank, world):
    sm, opt = _build("paro_iig", "node(2) > gpu(2)", 0, "adamw")
    _train(sm, opt, _data(world)[:K], rank, world)
    full, osd = sm.full_state_dict(), sm.full_optim_state_dict(opt)
    only0 = sm.full_state_dict(rank0_only=True), sm.full_optim_state_dict(opt, rank0_only=True)
    sm.faults.timeout = 3.0                         # the rendezvous only (process groups keep theirs)
    alone = None
    if rank == 0:                                   # the torch.save pattern, done wrong
        try:
            sm.full_state_dict()
        except Exception as e:                      # noqa: BLE001 — the message is the result
            alone = f"{type(e).__name__}: {e}"
    torch.distributed.barrier()                     # the others wait elsewhere meanwhile
    again = sm.full_state_dict()                    # every rank together still works after it
    return full, osd, only0, alone, max_rel_err(again, full)


def test_full_export_rank0_only_and_lone_caller():
    model = Tiny()
    ref = copy.deepcopy(model)
    opt = make_opt("adamw", [p for p in ref.parameters()])
    for x, y in _data(1)[:K]:
        loss_fn(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    names = {id(p): n for n, p in ref.named_parameters()}
    want = {names[id(p)]: st for p, st in opt.state.items()}
    res = dist_run(4, _export)
    for rank, (full, osd, (full0, osd0), alone, again) in enumerate(res):
        assert set(osd["state"]) == set(want) and osd["param_groups"][-1]["lr"] == 0.01
        for n, st in want.items():
            assert float(osd["state"][n]["step"]) == float(st["step"]) == K
            for key in ("exp_avg", "exp_avg_sq"):
                got = osd["state"][n][key]
                assert got.shape == st[key].shape
                assert float((got - st[key]).abs().max()) <= 1e-5 * float(st[key].abs().max()) + 1e-9
        if rank == 0:
            _same(full0, full)
            _same(osd0, osd)
            assert "full_state_dict() is a collective" in alone and "1 of 4" in alone, alone
        else:
            assert full0 == {} and osd0 == {} and alone is None
        assert again == 0.0


# -- bad input ------------------------------------------------------------------------------------
def _bad(rank, world, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp
    from shardc.runtime import shard_module
    sm, opt = _build("zero3", "node(2) > gpu(2)", 0, "adamw")
    _train(sm, opt, _data(world)[:1], rank, world)
    msd, osd = get_state_dict(sm, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    out = {}

    def attempt(label, sm2, opt2):
        before = sm2.full_state_dict()
        msd2, osd2 = get_state_dict(sm2, opt2)
        try:
            state = {"model": msd2, "optim": osd2}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(sm2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
            out[label] = None
        except BaseException as e:                  # noqa: BLE001 — DCP's CheckpointException too
            out[label] = str(e)
        out[label + "_untouched"] = max_rel_err(sm2.full_state_dict(), before)
        return sm2.full_state_dict()

    s = strategy("zero3", "node(2) > gpu(2)", accumulate=1)
    fewer = Tiny(n_blocks=2, seed=3)                # the checkpoint has blocks.2.*, this lacks it
    sm2 = shard_module(fewer, s, units_for(fewer, s.scopes))
    saved = sm.full_state_dict()
    got = attempt("extra", sm2, make_opt("adamw", sm2))
    out["extra_loaded"] = max_rel_err(got, {k: saved[k] for k in got})
    wider = Tiny(d=8, seed=3)                       # other shapes
    sm3 = shard_module(wider, s, units_for(wider, s.scopes))
    attempt("shape", sm3, make_opt("adamw", sm3))
    same = Tiny(seed=3)                             # same model, an optimizer with other state
    sm4 = shard_module(same, s, units_for(same, s.scopes))
    attempt("sgd", sm4, sm4.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9))
    same = Tiny(seed=3)                             # Adam: AdamW's state and hyperparameters
    sm5 = shard_module(same, s, units_for(same, s.scopes))
    adam = sm5.optimizer(torch.optim.Adam, lr=0.01)
    attempt("adam", sm5, adam)
    out["adam_decoupled"] = adam.param_groups[0]["decoupled_weight_decay"]
    return out


def test_bad_checkpoints_fail_as_torch_does_and_load_nothing(tmp_path):
    # [Note: the keys are torch's] in runtime/state/checkpoint.py: what DCP and torch refuse is refused
    # with their own error before anything changes; what they load, shardc loads too.
    for out in dist_run(4, _bad, str(tmp_path / "ckpt")):
        # more parameters in the checkpoint than in the model: DCP loads what the model asks for
        assert out["extra"] is None and out["extra_loaded"] == 0.0, out["extra"]
        assert "emb.weight" in out["shape"] and "mismatch" in out["shape"].lower(), out["shape"]
        assert "Missing key in checkpoint state_dict: optim." in out["sgd"], out["sgd"]
        # Adam and AdamW share their state; torch loads the saved hyperparameters with it
        assert out["adam"] is None and out["adam_decoupled"] is True, out["adam"]
        for label in ("shape", "sgd"):
            assert out[label + "_untouched"] == 0.0, label


# -- every element-wise optimizer ------------------------------------------------------------------
def _every_optimizer(rank, world, root):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp
    from shardc.runtime import ELEMENTWISE, shard_module
    s = strategy("zero3", "gpu(2)", accumulate=1)
    data = _data(world)
    out = {}
    for cls in ELEMENTWISE:
        sms = []
        for seed in (0, 5):
            model = Tiny(seed=seed)
            sm = shard_module(model, s, units_for(model, s.scopes))
            kw = {"momentum": 0.9} if cls is torch.optim.SGD else {}
            sms.append((sm, sm.optimizer(cls, lr=0.01, **kw)))
        (a, oa), (b, ob) = sms
        _train(a, oa, data[:K], rank, world)
        path = f"{root}/{cls.__name__}"
        msd, osd = get_state_dict(a, oa)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        msd, osd = get_state_dict(b, ob)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(b, ob, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = (_full(b, ob), _full(a, oa))
        _train(a, oa, data[K:], rank, world)
        _train(b, ob, data[K:], rank, world)
        out[cls.__name__] = (loaded, (_full(b, ob), _full(a, oa)))
    return out


def test_every_elementwise_optimizer_resumes_bit_for_bit(tmp_path):
    res = dist_run(2, _every_optimizer, str(tmp_path))
    for out in res:
        assert len(out) == 11
        for name, ((got, want), (got_after, want_after)) in out.items():
            assert want[1]["state"], name                    # the optimizer had state to save
            _same(got, want, f"{name} loaded")
            _same(got_after, want_after, f"{name} continued")
