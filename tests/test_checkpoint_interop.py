"""Checkpoints as torch has them: shardc's state dicts carry exactly the original model's
`state_dict()` keys, so torch's own recipes move a run between shardc, FSDP2, a plain model
and Hugging Face files.

A Hugging Face Llama (its rotary `inv_freq` is a non-persistent buffer, the case that
used to leak into shardc's state dict) on 4 gloo ranks, AdamW, K steps on each side of a
checkpoint, against one process trained on the concatenated batch for 2K steps:
- FSDP2 (`fully_shard` per layer and the root) saves with the README recipe, shardc
  (PaRO-IIG) resumes; and shardc saves, FSDP2 resumes. Parameters and AdamW moments equal
  the uninterrupted run to float32 rounding;
- `dcp_to_torch_save` of shardc's checkpoint loads with `load_state_dict(strict=True)`
  into the plain model, equal to the reference after K steps;
- `full_state_dict()` -> `save_pretrained` -> `from_pretrained` gives the same tensors.
"""
import pytest
import torch

import shardc
from tests.harness import dist_run

pytestmark = pytest.mark.distributed
WORLD, K, B, T, V = 4, 2, 2, 8, 64
STRATEGY = """strategy paro_iig
mesh node(2) > gpu(2)
params shard over gpu
grads  shard over gpu
optim  shard over world
"""
CFG = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=32)
LR = dict(lr=1e-2, weight_decay=0.1)


def llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CFG))


def batches(steps, offset=0):
    g = torch.Generator().manual_seed(11)
    xs = [torch.randint(0, V, (WORLD * B, T), generator=g) for _ in range(offset + steps)]
    return xs[offset:]


def train(model, opt, xs, rank=0, split=True):
    for x in xs:
        x = x.chunk(WORLD)[rank] if split else x
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


def _shardc(rank):
    sm = shardc.compile(llama(seed=rank), STRATEGY, example_inputs=(torch.zeros(B, T, dtype=torch.long),))
    return sm, sm.optimizer(torch.optim.AdamW, **LR)


def _fsdp2(seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = llama(seed)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), **LR)


def save(model, opt, path):                     # the README's recipe, as FSDP2 users write it
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def load(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _full_fsdp2(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return _plain(msd), {n: _plain(st) for n, st in osd["state"].items()}


def _plain(d):
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def _job(rank, world, root):
    from transformers import LlamaForCausalLM
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = {"keys": list(llama().state_dict())}
    # FSDP2 -> shardc
    model, opt = _fsdp2(seed=0)
    train(model, opt, batches(K), rank)
    save(model, opt, f"{root}/fsdp2")
    sm, sopt = _shardc(rank)
    out["sm_keys"] = list(sm.state_dict())
    out["get_state_dict_keys"] = list(__import__("torch.distributed.checkpoint.state_dict",
                                                 fromlist=["get_state_dict"]).get_state_dict(sm, sopt)[0])
    load(sm, sopt, f"{root}/fsdp2")
    train(sm, sopt, batches(K, K), rank)
    out["fsdp2_to_shardc"] = (_plain(sm.full_state_dict()), sm.full_optim_state_dict(sopt)["state"])
    # shardc -> FSDP2, and the single file
    sm, sopt = _shardc(rank)
    train(sm, sopt, batches(K), rank)
    save(sm, sopt, f"{root}/shardc")
    model, opt = _fsdp2(seed=5)
    load(model, opt, f"{root}/shardc")
    train(model, opt, batches(K, K), rank)
    out["shardc_to_fsdp2"] = _full_fsdp2(model, opt)
    torch.distributed.barrier()
    if rank == 0:
        dcp_to_torch_save(f"{root}/shardc", f"{root}/one.pt")
        plain = llama(seed=9)
        plain.load_state_dict(torch.load(f"{root}/one.pt")["model"], strict=True)
        out["single_file"] = _plain(plain.state_dict())
    # shardc -> save_pretrained -> from_pretrained
    full = sm.full_state_dict()
    if rank == 0:
        kept = _plain(full)                                  # save_pretrained empties what it writes
        llama(seed=9).save_pretrained(f"{root}/hf", state_dict=full)    # the plain model's class and config
        back = LlamaForCausalLM.from_pretrained(f"{root}/hf")
        out["hf"] = (kept, _plain(back.state_dict()))
    return out


def _reference():
    model = llama(seed=0)
    opt = torch.optim.AdamW(model.parameters(), **LR)
    train(model, opt, batches(K), split=False)
    at_k = _plain(model.state_dict())
    train(model, opt, batches(K, K), split=False)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: _plain(st) for p, st in opt.state.items()}
    return at_k, _plain(model.state_dict()), state


def _close(got, want, what):
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        if isinstance(want[k], torch.Tensor) and want[k].dim() > 0:
            rel = float((got[k].float() - want[k].float()).norm() / want[k].float().norm().clamp_min(1e-12))
            assert rel < 1e-5, f"{what} {k}: relative error {rel:.3g}"


def test_checkpoints_move_between_shardc_fsdp2_plain_torch_and_hugging_face(tmp_path):
    at_k, want, want_state = _reference()
    results = dist_run(WORLD, _job, str(tmp_path))
    for r in results:
        # exactly the original model's keys: no manifest, no non-persistent rotary buffer
        assert r["sm_keys"] == r["keys"] and r["get_state_dict_keys"] == r["keys"]
        assert not any("inv_freq" in k for k in r["keys"])
        params, state = r["fsdp2_to_shardc"]
        _close(params, want, "FSDP2 -> shardc params")
        for name, st in want_state.items():
            _close({k: state[name][k] for k in ("exp_avg", "exp_avg_sq")},
                   {k: st[k] for k in ("exp_avg", "exp_avg_sq")}, f"FSDP2 -> shardc AdamW {name}")
            assert float(state[name]["step"]) == float(st["step"]) == 2 * K
        params, state = r["shardc_to_fsdp2"]
        _close(params, want, "shardc -> FSDP2 params")
        for name, st in want_state.items():
            _close({k: state[name][k] for k in ("exp_avg", "exp_avg_sq")},
                   {k: st[k] for k in ("exp_avg", "exp_avg_sq")}, f"shardc -> FSDP2 AdamW {name}")
    _close(results[0]["single_file"], at_k, "dcp_to_torch_save -> load_state_dict(strict=True)")
    full, back = results[0]["hf"]
    assert set(full) == set(back)
    for k in full:
        assert torch.equal(full[k], back[k]), k
