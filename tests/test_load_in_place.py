"""Loads in place (issue 54): grad shards come at the first backward, and a safetensors load
fills the shards themselves.

A tiny HF Llama built on meta, compiled under ZeRO-3 on 4 gloo ranks: after compile and
after `shardc.load_safetensors` no grad shard exists (memory_report still counts their
planned size, N/s_G per group); the loaded values are `from_pretrained`'s (and under
PaRO-IIG, whose fp32 params shards over the node are read whole, the master a view of
them: runtime/state/checkpoint.py [Note: loads in place]); the first
backward allocates every trainable group's grad shard, and the step after the load
matches one process training `from_pretrained`'s model on the whole batch (the refused
bf16 load with dtype="checkpoint" in between changed nothing).

The reader (runtime/state/hf_reader.py, [Note: reads straight into the shard]): every box a
piece is cut into is one contiguous run of the file; a same-dtype read fills the target
itself, a cast goes through blocks of at most `BLOCK` bytes; its metadata equals torch's
`HuggingFaceStorageReader.read_metadata` from the headers alone.
"""
from __future__ import annotations

import pytest
import torch

from tests.harness import dist_run, failure
from tests.test_runtime_util import strategy

pytestmark = pytest.mark.distributed


def _cfg():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def _run(rank, world, path, bf16):
    import shardc
    from transformers import LlamaForCausalLM
    x = torch.randint(0, 64, (4 * world, 8), generator=torch.Generator().manual_seed(1))
    with torch.device("meta"):
        model = LlamaForCausalLM(_cfg())
    sm = shardc.compile(model, strategy("zero3", "node(1) > gpu(4)"), example_inputs=(x[:4],),
                        init=shardc.buffers_only(model._init_weights))
    stores = [g.storage for u in sm.runtime.units for g in u.groups if g.storage.trainable]
    out = {"at_compile": sum(st.grad_allocated for st in stores)}
    out["planned"] = sm.memory_report()["grads"] == sum(st.plan.chunk("grads", st.n)[1] * 4 for st in stores)
    shardc.load_safetensors(sm, path, dtype="checkpoint")         # fp32 files, fp32 strategy: no cast
    out["bf16"] = failure(lambda: shardc.load_safetensors(sm, bf16, dtype="checkpoint"))
    out["after_load"] = sum(st.grad_allocated for st in stores)
    ref = LlamaForCausalLM.from_pretrained(path).state_dict()
    got = sm.full_state_dict()
    out["values"] = [k for k, v in ref.items() if not torch.equal(got[k], v)]
    with torch.device("meta"):                  # PaRO-IIG: the params shards (over the node) read whole
        other = LlamaForCausalLM(_cfg())
    paro = shardc.compile(other, strategy("paro_iig", "node(2) > gpu(2)"), example_inputs=(x[:4],),
                          init=shardc.buffers_only(other._init_weights))
    shardc.load_safetensors(paro, path)
    got = paro.full_state_dict()
    out["paro_values"] = [k for k, v in ref.items() if not torch.equal(got[k], v)]
    opt = torch.optim.SGD(sm.parameters(), lr=0.1)
    xs = x[4 * rank:4 * rank + 4]
    sm(xs, labels=xs).loss.backward()
    out["after_backward"] = sum(st.grad_allocated for st in stores)
    out["groups"] = len(stores)
    opt.step()
    out["state"] = sm.full_state_dict()
    return out


def test_grad_shards_at_first_backward_and_load_in_place(tmp_path):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    path = str(tmp_path / "hf")
    LlamaForCausalLM(_cfg()).save_pretrained(path, max_shard_size="20KB")
    bf16 = str(tmp_path / "bf16")
    LlamaForCausalLM(_cfg()).to(torch.bfloat16).save_pretrained(bf16)
    results = dist_run(4, _run, path, bf16)
    ref = LlamaForCausalLM.from_pretrained(path)
    x = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x, labels=x).loss.backward()
    opt.step()
    want = ref.state_dict()
    for r in results:
        assert r["at_compile"] == 0 and r["after_load"] == 0 and r["planned"]
        assert r["values"] == [] and r["paro_values"] == []
        msg = r["bf16"]                        # dtype="checkpoint": a bf16 file into fp32 shards is refused
        assert msg.startswith("CheckpointError: ") and "bfloat16" in msg and "dtype bf16" in msg, msg
        assert r["after_backward"] == r["groups"] > 0
        for k, v in want.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_every_piece_box_is_one_run_of_the_file():
    from math import prod

    from shardc.runtime.state.hf_reader import file_range
    from shardc.runtime.state.pieces import boxes
    for shape in ((5, 7), (3, 4, 5), (6,)):
        n = prod(shape)
        for lo in range(n):
            for hi in range(lo + 1, n + 1):
                for off, size, a, b in boxes(shape, lo, hi):
                    assert file_range(shape, off, size) == (a, b - a), (shape, lo, hi, off, size)
    assert file_range((4, 6), (0, 2), (4, 2)) is None            # a column block is many runs


def test_reads_in_place_or_through_bounded_blocks(tmp_path, monkeypatch):
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from shardc.runtime.state import hf_reader
    w = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    save_file({"a": torch.zeros(3), "w": w}, str(tmp_path / "m.safetensors"))
    save_file({"v": w.to(torch.bfloat16)}, str(tmp_path / "n.safetensors"))
    files = sorted(str(p) for p in tmp_path.glob("*.safetensors"))
    assert hf_reader.metadata(files).state_dict_metadata == \
        HuggingFaceStorageReader(str(tmp_path)).read_metadata().state_dict_metadata
    base, head = hf_reader.header(files[0])
    target = torch.zeros(23)
    ptr = target.data_ptr()
    with open(files[0], "rb") as f:
        hf_reader.read_box(f, base + head["w"]["data_offsets"][0], torch.float32, 17, 23, target)
    assert target.data_ptr() == ptr and torch.equal(target, w.reshape(-1)[17:40])
    monkeypatch.setattr(hf_reader, "BLOCK", 8)                   # 4 bf16 elements a block
    base, head = hf_reader.header(files[1])
    with open(files[1], "rb") as f:
        hf_reader.read_box(f, base + head["v"]["data_offsets"][0], torch.bfloat16, 17, 23, target)
    assert torch.equal(target, w.to(torch.bfloat16).reshape(-1)[17:40].float())
