"""compiler/reuse.py: capture once per distinct block. Hugging Face GPT-2, Llama and
Mixtral (tiny configs built here, no weights) compile to the same Plan, byte for byte —
the `Lowering`, the units, the graph's runtime calls and the emitted module — with the
reuse as without it, and export traces the first of the L identical layers only (L - 1
calls stood in for). torchtitan's Llama 3 is compared when torchtitan is installed."""
import functools

import pytest
import torch

from shardc.compiler import api
from shardc.compiler.capture import capture
from tests.test_hf_models import SMALL, V

LAYERS = 3
ZERO3 = """strategy z3
mesh node(2) > gpu(2)
params shard over world
grads  shard over world
optim  shard over world
bucket 0
"""
BUCKETED = ZERO3.replace("bucket 0", "bucket 80KB")      # units of several layers (a bucket merge)


def hf_model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=LAYERS, n_head=2))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_hidden_layers": LAYERS}))
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(**{**SMALL, "num_hidden_layers": LAYERS}, num_local_experts=4,
                                            num_experts_per_tok=2))


def titan_model():
    titan = pytest.importorskip("torchtitan.models.llama3", reason="torchtitan is not installed")
    args = titan.TransformerModelArgs(dim=32, n_layers=LAYERS, n_heads=4, n_kv_heads=2, vocab_size=V)
    with torch.device("meta"):
        return titan.Transformer(args)


def compiled(model, strategy, inputs, reuse, monkeypatch):
    seen = {}

    def recording(*a, **k):
        gm = capture(*a, **k, reuse=reuse)
        seen["reused"] = gm.meta["shardc"].reused
        return gm
    monkeypatch.setattr(api, "capture_graph", recording)
    source, plan = api.compile_source(model, strategy, inputs, capture="export", world_size=4)
    return source, plan, seen["reused"]


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral", "titan"])
def test_same_plan_with_and_without_reuse(kind, monkeypatch):
    model = titan_model() if kind == "titan" else hf_model(kind)
    inputs = (torch.randint(0, V, (2, 8), device="meta" if kind == "titan" else "cpu"),)
    src0, plan0, n0 = compiled(model, ZERO3, inputs, False, monkeypatch)
    src1, plan1, n1 = compiled(model, ZERO3, inputs, True, monkeypatch)
    assert (n0, n1) == (0, LAYERS - 1)          # the first layer traced, the others stood in for
    assert repr(plan1.lowering) == repr(plan0.lowering)
    assert plan1 == plan0 and src1 == src0


def test_bucketed_units_keep_their_regions(monkeypatch):
    """Units of several layers: the same regions, so the same plan."""
    model = hf_model("llama")
    inputs = (torch.randint(0, V, (2, 8)),)
    src0, plan0, _ = compiled(model, BUCKETED, inputs, False, monkeypatch)
    src1, plan1, n1 = compiled(model, BUCKETED, inputs, True, monkeypatch)
    assert any(len(u.modules) > 1 for u in plan1.units) and n1 > 0
    assert repr(plan1.lowering) == repr(plan0.lowering) and plan1 == plan0 and src1 == src0


def test_model_untouched_after_capture():
    """The stand-ins are gone after the capture: the model's forward is its own again."""
    model = hf_model("llama")
    from shardc.units import find_units
    from tests.test_capture import S
    x = torch.randint(0, V, (2, 8))
    before = model(x).logits
    capture(model, find_units(model, S), (x,), mode="export")
    assert all("forward" not in m.__dict__ for m in model.modules())
    torch.testing.assert_close(model(x).logits, before, rtol=0, atol=0)
