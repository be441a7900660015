"""What FSDP2 users type, on FSDP2 and on shardc, with the same answers (runtime/state/params.py).

The same lines run against FSDP2 (`fully_shard` per block and the root) and shardc
(ZeRO-3 and PaRO-IIG; DDP where a piece is the whole tensor) on 4 gloo ranks, against
one process on the whole batch:
- `sum(p.numel() for p in m.parameters())` and nanoGPT's `p.dim() >= 2` split are the
  unsharded model's;
- `torch.optim.SGD(momentum)` / `AdamW(m.parameters())` with torch's own
  `clip_grad_norm_(m.parameters(), 0.5)` train at parity, each step's norm equal;
- `parameters_to_vector` and `copy.deepcopy` fail (FSDP2: its errors; shardc: one sentence
  naming the call), except on whole pieces (DDP), where `parameters_to_vector` is right;
  `p.detach()` and `p.data` keep the whole tensor's shape and norm;
- a parameter frozen after sharding (`requires_grad_(False)`) gets no gradient and keeps
  its value; `zero_grad(set_to_none=False)` steps at parity;
- `get_model_state_dict` / `get_optimizer_state_dict` with `full_state_dict=True` (with and
  without `cpu_offload`) equal `full_state_dict()` / `full_optim_state_dict()`;
  `set_model_state_dict(broadcast_from_rank0=True)` loads;
- a resume through `get_state_dict`, `dcp.load`, `set_state_dict` records nothing in the
  ledger (loads are not step traffic) and moves no parameter.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.harness import dist_run
from tests.test_runtime_util import Tiny, batches, loss_fn, max_rel_err, reference, strategy, units_for

pytestmark = pytest.mark.distributed
KINDS = {"sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
         "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1))}
TOL = 1e-5


def _build(system: str, model):
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from shardc.runtime import shard_module
    s = strategy(system, "node(2) > gpu(2)", accumulate=1)
    return shard_module(model, s, units_for(model, s.scopes))


def _full(system: str, m) -> dict:
    if system == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
    return m.full_state_dict()


def _norm(n) -> float:
    return float(n.full_tensor() if hasattr(n, "full_tensor") else n)


def _train(rank, world, system, kind, data, freeze=None, set_to_none=True):
    m = _build(system, Tiny())
    cls, kw = KINDS[kind]
    if freeze:
        dict(m.named_parameters())[freeze].requires_grad_(False)
    opt = cls(m.parameters(), **kw)
    norms = []
    for x, y in data:
        loss_fn(m(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        norms.append(_norm(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    frozen = freeze and dict(m.named_parameters())[freeze].grad
    return m, opt, norms, frozen


def _raises(fn) -> str:
    try:
        fn()
    except Exception as e:                          # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def _parity(rank, world):
    out = {}
    data = batches(3, world, 1)
    plain = Tiny()
    out["count"] = (sum(p.numel() for p in plain.parameters()), sum(p.dim() >= 2 for p in plain.parameters()))
    for kind in KINDS:
        want, want_norms = reference(plain, data, kind, clip=0.5)
        for system in ("fsdp2", "zero3", "paro_iig"):
            m, _, norms, _ = _train(rank, world, system, kind, data)
            counted = (sum(p.numel() for p in m.parameters()), sum(p.dim() >= 2 for p in m.parameters()))
            out[system, kind] = (counted, max_rel_err(_full(system, m), want),
                                 max(abs(a - b) / b for a, b in zip(norms, want_norms)))
    return out


def test_torch_optimizers_and_clipping_on_the_parameters_train_at_parity():
    for r in dist_run(4, _parity):
        count = r.pop("count")
        for case, (counted, err, norm_err) in r.items():
            assert counted == count, case
            assert err < TOL and norm_err < TOL, (case, err, norm_err)


def _misuse(rank, world):
    out = {}
    for system in ("fsdp2", "zero3", "ddp"):
        m = _build(system, Tiny())
        out[system, "p2v"] = _raises(lambda: torch.nn.utils.parameters_to_vector(m.parameters()))
        out[system, "deepcopy"] = _raises(lambda: copy.deepcopy(m))
        if system == "zero3":             # detach() and .data keep the whole tensor's rules (FSDP2: DTensors)
            w = dict(m.named_parameters())["blocks.0.up.weight"]
            whole = w.full_tensor()
            out["detach_norm"] = float(torch.linalg.vector_norm(w.detach()) - whole.norm())
            out["data_norm"] = float(w.data.norm() - whole.norm())
            out["detach_shape"] = tuple(w.detach().shape) == tuple(whole.shape)
            out["data_view"] = _raises(lambda: w.data.view(-1))
        if system == "ddp":
            vec = torch.nn.utils.parameters_to_vector(m.parameters())
            out["ddp_vector"] = bool(torch.equal(vec, torch.nn.utils.parameters_to_vector(Tiny().parameters())))
    data = batches(2, world, 1)
    for system in ("fsdp2", "zero3"):
        name = "blocks.1.up.weight"
        before = Tiny().state_dict()[name]
        m, _, _, grad = _train(rank, world, system, "adamw", data, freeze=name)
        full = _full(system, m)
        out[system, "frozen"] = (grad is None, bool(torch.equal(full[name], before)),
                                 not torch.equal(full["blocks.1.down.weight"], Tiny().state_dict()["blocks.1.down.weight"]))
    want, _ = reference(Tiny(), data, "sgd", clip=0.5)
    m, _, _, _ = _train(rank, world, "zero3", "sgd", data, set_to_none=False)
    out["zero_in_place"] = max_rel_err(m.full_state_dict(), want)
    return out


def test_misuse_fails_as_fsdp2_does_and_freezing_works():
    for r in dist_run(4, _misuse):
        assert r["fsdp2", "p2v"].startswith("RuntimeError: Cannot flatten unevenly sharded tensor"), r
        assert r["zero3", "p2v"].startswith("RuntimeUsageError: view() reshapes or indexes 'emb.weight', but on a "
                                            "shardc model that tensor is this rank's piece"), r
        assert r["ddp", "p2v"] == "no error" and r["ddp_vector"], r
        assert r["fsdp2", "deepcopy"].startswith("AssertionError: FSDP does not support deepcopy"), r
        assert abs(r["detach_norm"]) < 1e-6 and abs(r["data_norm"]) < 1e-6 and r["detach_shape"], r
        assert r["data_view"].startswith("RuntimeUsageError: view() reshapes or indexes 'blocks.0.up.weight'"), r
        for s in ("zero3", "ddp"):
            assert r[s, "deepcopy"].startswith("RuntimeUsageError: a ShardedModule cannot be deep-copied"), r
        assert r["fsdp2", "frozen"] == r["zero3", "frozen"] == (True, True, True), r
        assert r["zero_in_place"] < TOL, r


def _state_dicts(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, get_state_dict,
                                                         set_model_state_dict, set_state_dict)
    out = {}
    m, opt, _, _ = _train(rank, world, "paro_iig", "adamw", batches(2, world, 1))
    full, optim = m.full_state_dict(), m.full_optim_state_dict(opt)
    for offload in (False, True):
        opts = StateDictOptions(full_state_dict=True, cpu_offload=offload)
        got = get_model_state_dict(m, options=opts)
        gosd = get_optimizer_state_dict(m, opt, options=opts)
        if offload and rank != 0:                    # torch keeps rank 0's only
            out[offload] = (got, gosd) == ({}, {})
            continue
        out[offload] = (list(got) == list(full) and all(torch.equal(got[k], v) for k, v in full.items())
                        and sorted(gosd["state"]) == sorted(optim["state"])
                        and all(torch.equal(gosd["state"][n][k], v) for n, st in optim["state"].items()
                                for k, v in st.items()))
    fresh = _build("zero3", Tiny(seed=7))
    sd = full if rank == 0 else {}
    set_model_state_dict(fresh, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    out["broadcast"] = all(torch.equal(fresh.full_state_dict()[k], v) for k, v in full.items())
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    again = _build("zero3", Tiny(seed=7))
    opt2 = torch.optim.AdamW(again.parameters(), **KINDS["adamw"][1])
    again.reset_comm_ledger()
    msd, osd = get_state_dict(again, opt2)            # torch steps opt2 once on zeros to make its state
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(again, opt2, model_state_dict=msd, optim_state_dict=osd)
    out["ledger"] = again.comm_ledger()
    out["resumed"] = all(torch.equal(again.full_state_dict()[k], v) for k, v in full.items())
    return out


def test_torch_full_state_dicts_and_a_quiet_resume(tmp_path):
    for r in dist_run(4, _state_dicts, str(tmp_path / "ckpt")):
        assert r == {False: True, True: True, "broadcast": True, "ledger": [], "resumed": True}, r
