"""The model's own state-dict hooks on every state-dict path (runtime/state/hooks.py).

`HookedNet` saves its fused `wqkv` as `q`, `k`, `v` (interleaved rows, as torchtitan's
fused QKV does, DTensors made whole first) and fuses them back in a load pre-hook; its
norm saves `scale` under the name `weight` (a pure rename); a counter module keeps
`_extra_state`. On 4 gloo ranks under ZeRO-3 (the public `shardc.compile`, so the
emitted `shard_model`), after two AdamW steps against one process on the whole batch:
- `full_state_dict()`, `state_dict()` (its keys), `get_model_state_dict(full_state_dict=True,
  cpu_offload=True)` all equal the unsharded model's `state_dict()`;
- `load_full_state_dict(model.state_dict())` loads it; torch's `set_model_state_dict` with
  `broadcast_from_rank0` (which keeps only parameter-named entries) is one sentence naming
  the hook's module, and changes nothing;
- torch's DCP recipe (`get_state_dict`, `dcp.save`; `dcp.load`, `set_state_dict`) resumes
  on 2 ranks under PaRO-IIG with AdamW state, equal to the uninterrupted run;
- `dcp_to_torch_save` loads strictly into the plain model.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import dist_run

pytestmark = pytest.mark.distributed
D, V, T = 8, 16, 6
LR = dict(lr=1e-2, weight_decay=0.1)
ZERO3 = "strategy zero3\nmesh node(2) > gpu(2)\nparams shard over world\ngrads shard over world\noptim shard over world\n"
PARO = "strategy paro_iig\nmesh node(1) > gpu(2)\nparams shard over gpu\ngrads shard over gpu\noptim shard over world\n"


def _whole(t):
    from torch.distributed.tensor import DTensor, Replicate
    return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim) if isinstance(t, DTensor) else t


class FusedQKV(nn.Module):
    """One parameter, three state-dict entries: rows interleaved per head (h heads of d/h)."""

    def __init__(self, d, heads=2):
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._fuse)

    def forward(self, x):
        q, k, v = self.wqkv(x).chunk(3, -1)
        return x + torch.sigmoid(q * k) * v

    @staticmethod
    def _split(module, sd, prefix, local_metadata):
        w = _whole(sd.pop(prefix + "wqkv.weight"))
        parts = w.reshape(module.heads, 3, -1, w.shape[1])
        for i, name in enumerate("qkv"):
            sd[f"{prefix}{name}.weight"] = parts[:, i].reshape(-1, w.shape[1]).contiguous()

    @staticmethod
    def _fuse(module, sd, prefix, *args):
        keys = [f"{prefix}{n}.weight" for n in "qkv"]
        if all(k in sd for k in keys):
            q, k, v = (_whole(sd.pop(key)) for key in keys)
            parts = [t.reshape(module.heads, 1, -1, t.shape[1]) for t in (q, k, v)]
            sd[prefix + "wqkv.weight"] = torch.cat(parts, 1).reshape(-1, q.shape[1])


class Norm(nn.Module):
    """Its parameter `scale` is saved as `weight` (a rename: the piece itself is handed back)."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self._register_state_dict_hook(self._rename)
        self.register_load_state_dict_pre_hook(self._back)

    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6) * self.scale

    @staticmethod
    def _rename(module, sd, prefix, local_metadata):
        sd[prefix + "weight"] = sd.pop(prefix + "scale")

    @staticmethod
    def _back(module, sd, prefix, *args):
        if prefix + "weight" in sd:
            sd[prefix + "scale"] = sd.pop(prefix + "weight")


class Counter(nn.Module):
    """Keeps `_extra_state` (a plain object)."""

    def __init__(self):
        super().__init__()
        self.steps = 3

    def forward(self, x):
        return x

    def get_extra_state(self):
        return {"steps": self.steps}

    def set_extra_state(self, state):
        self.steps = state["steps"]


class HookedNet(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([nn.Sequential(FusedQKV(D), Norm(D)) for _ in range(2)])
        self.count = Counter()
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.count(h))


def _data(steps, world):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (world * 2, T), generator=g) for _ in range(steps)]


def _step(model, opt, x):
    out = model(x[:, :-1])
    nn.functional.cross_entropy(out.reshape(-1, V), x[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


def _reference(steps, world):
    model = HookedNet()
    opt = torch.optim.AdamW(model.parameters(), **LR)
    for x in _data(steps, world):
        _step(model, opt, x)
    return model


def _equal(got: dict, want: dict, tol=1e-6) -> list:
    assert list(got) == list(want), (list(got), list(want))
    bad = []
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            if g.shape != w.shape or not torch.allclose(g.float(), w.float(), atol=tol, rtol=tol):
                bad.append(k)
        elif g != w:
            bad.append(k)
    return bad


def _compile(strategy, rank):
    import shardc
    return shardc.compile(HookedNet(seed=rank), strategy, example_inputs=(torch.zeros(2, T - 1, dtype=torch.long),))


def _save_job(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_state_dict, set_model_state_dict)
    sm = _compile(ZERO3, rank)
    plain = HookedNet()
    out = {}
    # the start: every rank's values come from rank 0 (seed 0), as the plain model's
    out["keys"] = list(sm.state_dict()) == list(plain.state_dict())
    out["start"] = _equal(sm.full_state_dict(), plain.state_dict())
    sm.load_full_state_dict(plain.state_dict())
    opt = torch.optim.AdamW(sm.parameters(), **LR)
    for x in _data(2, world):
        _step(sm, opt, x.chunk(world)[rank])
    want = _reference(2, world).state_dict()
    full = sm.full_state_dict()
    out["trained"] = _equal(full, want, 1e-5)
    torch_full = get_model_state_dict(sm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["torch_full"] = _equal(torch_full, full, 0) if rank == 0 else [k for k in torch_full]   # rank 0 only
    msd, osd = get_state_dict(sm, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    # broadcast_from_rank0 keeps only parameter-named entries (torch): one sentence, naming the hook's module
    sd = HookedNet(seed=5).state_dict() if rank == 0 else {}
    try:
        set_model_state_dict(sm, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        out["broadcast"] = "loaded"
    except Exception as e:                          # noqa: BLE001
        out["broadcast"] = f"{type(e).__name__}: {e}"
    # any other miss is torch's own error (here: the hook cannot fuse without v)
    partial = HookedNet(seed=5).state_dict()
    del partial["blocks.0.0.v.weight"]
    try:
        sm.load_state_dict(partial)
        out["torch_error"] = "loaded"
    except Exception as e:                          # noqa: BLE001
        out["torch_error"] = f"{type(e).__name__}: {e}"
    out["unchanged"] = _equal(sm.full_state_dict(), full, 0)
    return out


def _resume_job(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    sm = _compile(PARO, rank)
    opt = torch.optim.AdamW(sm.parameters(), **LR)
    msd, osd = get_state_dict(sm, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(sm, opt, model_state_dict=msd, optim_state_dict=osd)
    data = _data(4, 4)
    for x in data[2:]:                     # the same global batches, 2 ranks of half as many rows
        _step(sm, opt, x.chunk(world)[rank])
    return _equal(sm.full_state_dict(), _reference(4, 4).state_dict(), 1e-5)


def test_hooks_run_on_every_state_dict_path(tmp_path):
    path = str(tmp_path / "ckpt")
    for r in dist_run(4, _save_job, path):
        said, torch_error = r.pop("broadcast"), r.pop("torch_error")
        assert torch_error.startswith("RuntimeError: Error(s) in loading state_dict for HookedNet:\n\tMissing "
                                      "key(s) in state_dict: \"blocks.0.0.wqkv.weight\". \n\tUnexpected key(s) in "
                                      "state_dict: \"blocks.0.0.q.weight\", \"blocks.0.0.k.weight\""), torch_error
        assert r == dict(keys=True, start=[], trained=[], torch_full=[], unchanged=[]), r
        assert said.startswith("RuntimeUsageError: "), said           # on every rank, rank 0 included
        assert ("the state dict has no 'blocks.0.0.wqkv.weight', which FusedQKV 'blocks.0.0' saves under other "
                "keys through its own state-dict hook") in said, said
    for bad in dist_run(2, _resume_job, path):
        assert bad == [], bad
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(path, str(tmp_path / "ckpt.pt"))
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"]
    plain = HookedNet(seed=9)
    plain.load_state_dict(saved, strict=True)
    assert _equal(plain.state_dict(), _reference(2, 4).state_dict(), 1e-5) == []
