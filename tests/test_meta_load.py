"""Loading straight into the shards of a model built on the meta device (init=False).

- DCP (torch's recipe: `get_state_dict`, `dcp.load`, `set_state_dict`) from a shardc run
  under another strategy, from FSDP2, and from a seed checkpoint saved by one process
  (torchtitan's) equals the saved values, AdamW state included where one was saved.
- A Hugging Face `save_pretrained` directory (GPT-2 in one file; Llama in several with an
  index, its rotary cache recomputed by `init=shardc.buffers_only(model._init_weights)`)
  through `shardc.load_safetensors` equals `from_pretrained` in one process, and the forward
  gives its logits.
"""
from __future__ import annotations

import pytest
import torch

from tests.harness import dist_run
from tests.test_runtime_util import Tiny, batches, loss_fn, strategy, units_for

pytestmark = pytest.mark.distributed
LR = dict(lr=0.01, weight_decay=0.1)


def _meta_sharded(name, mesh, init=False):
    from shardc.runtime import shard_module
    with torch.device("meta"):
        model = Tiny()
    s = strategy(name, mesh)
    return shard_module(model, s, units_for(model, s.scopes), init=init)


def _trained(rank, world, system):
    """One AdamW step on the whole model: (model, optimizer) of `system`."""
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        model = Tiny(seed=4)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        m = fully_shard(model, mesh=mesh)
    else:
        from shardc.runtime import shard_module
        model = Tiny(seed=4)
        s = strategy(system, "node(2) > gpu(2)")
        m = shard_module(model, s, units_for(model, s.scopes))
    opt = torch.optim.AdamW(m.parameters(), **LR)
    x, y = batches(1, world, 1)[0]
    loss_fn(m(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def _dcp(rank, world, root, seed_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    out = {}
    for system in ("paro_iig", "fsdp2"):
        m, opt = _trained(rank, world, system)
        msd, osd = get_state_dict(m, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/{system}")
        full, fopt = _full(m, opt)
        sm = _meta_sharded("zero3", "node(2) > gpu(2)")
        opt2 = torch.optim.AdamW(sm.parameters(), **LR)
        msd, osd = get_state_dict(sm, opt2)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{root}/{system}")
        set_state_dict(sm, opt2, model_state_dict=msd, optim_state_dict=osd)
        got, gopt = _full(sm, opt2)
        out[system] = ([k for k in full if not torch.equal(got[k], full[k])],
                       [k for k in fopt if not torch.equal(gopt[k], fopt[k])])
    sm = _meta_sharded("paro_nig", "node(2) > gpu(2)")
    sd = sm.state_dict()
    dcp.load(sd, checkpoint_id=seed_path)
    sm.load_state_dict(sd)
    want = Tiny(seed=9).state_dict()
    out["seed"] = [k for k, v in sm.full_state_dict().items() if not torch.equal(v, want[k])]
    return out


def _full(m, opt) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True)
    osd = get_optimizer_state_dict(m, opt, options=opts)["state"]
    flat = {f"{n}.{k}": v for n, st in osd.items() for k, v in st.items() if torch.is_tensor(v) and v.dim()}
    return get_model_state_dict(m, options=opts), flat


def test_dcp_checkpoints_load_into_a_meta_built_model(tmp_path):
    import torch.distributed.checkpoint as dcp
    seed = str(tmp_path / "seed")
    dcp.save(Tiny(seed=9).state_dict(), checkpoint_id=seed, no_dist=True)    # one process, no group
    for r in dist_run(4, _dcp, str(tmp_path), seed):
        assert r == {"paro_iig": ([], []), "fsdp2": ([], []), "seed": []}, r


def _gpt2_cfg():
    from transformers import GPT2Config
    return GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)


def _llama_cfg():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def _hf(rank, world, paths):
    import shardc
    from transformers import GPT2LMHeadModel, LlamaForCausalLM
    out = {}
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for kind, cls, cfg in (("gpt2", GPT2LMHeadModel, _gpt2_cfg()), ("llama", LlamaForCausalLM, _llama_cfg())):
        with torch.device("meta"):
            model = cls(cfg)
        sm = shardc.compile(model, strategy("zero3", "node(1) > gpu(2)"), example_inputs=(x,),
                            init=shardc.buffers_only(model._init_weights))
        shardc.load_safetensors(sm, paths[kind])
        ref = cls.from_pretrained(paths[kind])
        got = sm.full_state_dict()
        out[kind] = [k for k, v in ref.state_dict().items() if not torch.equal(got[k], v)]
        sm.eval()                          # from_pretrained gives an eval model (GPT-2's dropout)
        with torch.no_grad():
            out[kind + "_logits"] = float((sm(x).logits - ref(x).logits).abs().max())
    return out


def test_hugging_face_weights_load_straight_into_shards(tmp_path):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM
    torch.manual_seed(0)
    paths = {"gpt2": str(tmp_path / "gpt2"), "llama": str(tmp_path / "llama")}
    GPT2LMHeadModel(_gpt2_cfg()).save_pretrained(paths["gpt2"])
    LlamaForCausalLM(_llama_cfg()).save_pretrained(paths["llama"], max_shard_size="20KB")   # several files
    assert (tmp_path / "llama" / "model.safetensors.index.json").exists()
    for r in dist_run(2, _hf, paths):
        assert r["gpt2"] == [] and r["llama"] == [], r
        assert r["gpt2_logits"] < 1e-5 and r["llama_logits"] < 1e-5, r
