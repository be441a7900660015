"""Bad checkpoints: one sentence on every rank, nothing half-loaded (issues 52 and 54).

A `save_pretrained` directory of a tiny HF Llama, spoiled one way per case, is loaded with
`shardc.load_safetensors` into a model built on the meta device on 4 gloo ranks under
ZeRO-3. Every rank gets the same one-sentence `CheckpointError` naming the tensor (and the
file), with no traceback text, and the model keeps the values it had: a good load after a
bad one gives `from_pretrained`'s values. A wrong dtype is not an error (the rule: values
take the strategy's dtype, cast on the way: a bf16 directory loads into fp32 shards). torch's own recipe (`dcp.load`) under
`shardc.checkpoint_errors` gives the same sentence. The index is followed: a stale
single file beside a sharded set is never read, and without an index a tensor in two
files is refused naming both.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.harness import dist_run, failure
from tests.test_runtime_util import strategy

pytestmark = pytest.mark.distributed


def _cfg(**kw):
    from transformers import LlamaConfig
    return LlamaConfig(**dict(dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32), **kw))


CASES = ("shape", "missing", "extra_strict", "extra", "other_class")


def _spoil(src: str, dst: str, fn) -> str:
    """A copy of the single-file directory `src` whose tensors `fn` changes."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    fn(sd)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _loads(rank, world, good, bad):
    import torch.distributed.checkpoint as dcp

    import shardc
    from transformers import LlamaForCausalLM
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = LlamaForCausalLM(_cfg())
    sm = shardc.compile(model, strategy("zero3", "node(1) > gpu(4)"), example_inputs=(x,),
                        init=shardc.buffers_only(model._init_weights))
    shardc.load_safetensors(sm, good)
    before = sm.full_state_dict()
    out = {}
    for case in CASES:
        path = bad[case]
        strict = case == "extra_strict"
        out[case] = failure(lambda: shardc.load_safetensors(sm, path, strict=strict))
        after = sm.full_state_dict()
        out[case + "_kept"] = all(torch.equal(after[k], v) for k, v in before.items())
    # torch's recipe: the same sentence through checkpoint_errors
    msd = sm.state_dict()
    out["dcp"] = failure(lambda: _dcp_load(shardc, dcp, msd, bad["dcp"]))
    now = sm.full_state_dict()
    out["dcp_changed"] = [k for k, v in before.items() if not torch.equal(now[k], v)]
    ref = LlamaForCausalLM.from_pretrained(good).state_dict()
    out["good"] = [k for k, v in ref.items() if not torch.equal(before[k], v)]
    # a bf16 directory is no error: values take the model's fp32, cast on the way
    out["bf16"] = failure(lambda: shardc.load_safetensors(sm, bad["bf16"]))
    cast = sm.full_state_dict()
    out["bf16_values"] = [k for k, v in ref.items() if not torch.equal(cast[k], v.bfloat16().float())]
    out["bf16_dtype"] = sorted({str(v.dtype) for v in cast.values()})
    out["stale"] = failure(lambda: shardc.load_safetensors(sm, bad["stale_dir"]))
    stale = sm.full_state_dict()
    out["stale_values"] = [k for k, v in ref.items() if not torch.equal(stale[k], v)]
    return out


def _dcp_load(shardc, dcp, msd, path):
    with shardc.checkpoint_errors(path):
        dcp.load({"model": msd}, checkpoint_id=path)


def test_bad_checkpoints_are_one_sentence_and_load_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    good = str(tmp_path / "good")
    LlamaForCausalLM(_cfg()).save_pretrained(good)
    bad = {
        "shape": _spoil(good, str(tmp_path / "shape"), lambda sd: sd.update({"lm_head.weight": torch.zeros(65, 32)})),
        "missing": _spoil(good, str(tmp_path / "missing"), lambda sd: sd.pop("model.norm.weight")),
        "extra_strict": _spoil(good, str(tmp_path / "extra"), lambda sd: sd.update({"model.extra": torch.ones(3)})),
        "extra": str(tmp_path / "extra"),
        "other_class": str(tmp_path / "gpt2"),
    }
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16)).save_pretrained(bad["other_class"])
    # a DCP checkpoint of a wider vocabulary, for torch's recipe
    wide = LlamaForCausalLM(_cfg(vocab_size=72))
    bad["dcp"] = str(tmp_path / "dcp")
    dcp.save({"model": wide.state_dict()}, checkpoint_id=bad["dcp"])
    # the sharded set re-saved over an older single file: the index is followed
    stale_dir = tmp_path / "stale"
    LlamaForCausalLM(_cfg()).save_pretrained(str(stale_dir))                  # stale: other values
    os.rename(stale_dir / "model.safetensors", tmp_path / "old.safetensors")
    shutil.rmtree(stale_dir)
    shutil.copytree(good, stale_dir)
    os.remove(stale_dir / "model.safetensors")
    LlamaForCausalLM.from_pretrained(good).save_pretrained(str(stale_dir), max_shard_size="20KB")
    assert (stale_dir / "model.safetensors.index.json").exists()
    shutil.copy(tmp_path / "old.safetensors", stale_dir / "model.safetensors")
    bad["stale_dir"] = str(stale_dir)
    bad["bf16"] = _spoil(good, str(tmp_path / "bf16"), lambda sd: sd.update({k: v.bfloat16() for k, v in sd.items()}))
    results = dist_run(4, _loads, good, bad)
    for r in results:
        assert r == results[0], "ranks disagree"
        assert r["good"] == []
        assert r["dcp_changed"] == []
        for case in (*CASES[:3], "other_class", "dcp"):
            msg = r[case]
            assert msg is not None and msg.startswith("CheckpointError: "), (case, msg)
            assert "Traceback" not in msg and "\n" not in msg and "CheckpointException" not in msg, (case, msg)
            assert case == "dcp" or r[case + "_kept"], case
        assert "lm_head.weight" in r["shape"] and "(65, 32)" in r["shape"] and "(64, 32)" in r["shape"]
        assert "model.safetensors" in r["shape"]
        assert "'model.norm.weight'" in r["missing"] and str(tmp_path / "missing") in r["missing"]
        assert "'model.extra'" in r["extra_strict"] and r["extra"] is None and r["extra_kept"]
        assert "embed_tokens.weight" in r["dcp"] and "(72, 32)" in r["dcp"] and "(64, 32)" in r["dcp"]
        assert r["stale"] is None and r["stale_values"] == []
        assert r["bf16"] is None and r["bf16_values"] == [] and r["bf16_dtype"] == ["torch.float32"]


def test_without_an_index_a_tensor_in_two_files_is_refused(tmp_path):
    from safetensors.torch import save_file

    from shardc.runtime.state.hf import checkpoint_files, tensor_files
    save_file({"a": torch.zeros(2), "b": torch.ones(2)}, str(tmp_path / "model-1.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    _, files = checkpoint_files(str(tmp_path))
    msg = failure(lambda: tensor_files(files))
    assert msg.startswith("ShardcError: ") and "'a'" in msg
    assert "model-1.safetensors" in msg and "model.safetensors" in msg
    # an index that maps a tensor to a file lacking it is one sentence too
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors",
                                                                                   "b": "model.safetensors"}}))
    msg = failure(lambda: checkpoint_files(str(tmp_path)))
    assert msg.startswith("ShardcError: ") and "'b'" in msg and "model-1.safetensors does" in msg
