"""Every strategy example of docs/language.md's statements runs against a real model: each
fenced block (a statement alone gets a mesh line) is loaded by the DSL and cut into units
on the model it is written for — examples/gpt.py:tiny, the tests' Tiny (`blocks.N`),
examples/moe.py (`layers.*.moe.experts`), or a Hugging Face Llama (`LlamaDecoderLayer`) —
with every override matching a unit (units/find.py, [Note: an override names a module]).
The docs' `override "lm_head"` makes the head a unit of its own."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from tests.test_runtime_util import ROOT, Tiny

MESH = "node(2) > gpu(4)"


def _examples() -> list[str]:
    """The blocks; a block whose lines are alternatives of one statement (two `mesh` lines)
    is one example per line."""
    text = open(os.path.join(ROOT, "docs", "language.md")).read()
    body = text[text.index("## Statements"):text.index("## The resolved strategy")]
    out = []
    for b in re.findall(r"^```\n(.*?)^```", body, re.S | re.M):
        lines = [ln for ln in b.splitlines() if ln.strip() and not ln.startswith("#")]
        firsts = {ln.split()[0] for ln in lines}
        out += lines if len(lines) > 1 and len(firsts) == 1 and "{" not in b else [b]
    return out


def _with_context(text: str) -> str:
    """A statement alone gets the rest of a strategy: the mesh, and the scopes the docs
    state for the override examples (params and grads over gpu, optim over the world);
    grads over the world when the example's params are sharded wider."""
    has = lambda kw: re.search(rf"^{kw}\b", text, re.M)  # noqa: E731
    grads = "grads shard over world" if has("params") else "grads shard over gpu"
    ctx = [("mesh", "mesh node(2) > gpu(4)"), ("params", "params shard over gpu"), ("grads", grads),
           ("optim", "optim shard over world")]
    return "".join(line + "\n" for kw, line in ctx if not has(kw)) + text


def _model(text: str):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    with torch.device("meta"):
        if "blocks" in text:
            return Tiny()
        if "experts" in text:
            import moe
            return moe.moe_tiny()
        if "LlamaDecoderLayer" in text:
            transformers = pytest.importorskip("transformers", reason="the Hugging Face example needs transformers")
            cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4)
            return transformers.LlamaForCausalLM(cfg)
        import gpt
        return gpt.tiny()


@pytest.mark.parametrize("text", _examples(), ids=lambda t: t.strip().splitlines()[0][:40])
def test_docs_example_runs_on_a_model(text):
    import shardc
    from shardc.analysis.costmodel.report import model_units
    s = shardc.load_strategy(_with_context(text), mesh="node(2) > gpu(2) > gcd(2)" if "gcd" in text else MESH)
    units = model_units(s, _model(text))
    assert len(units) >= 1


def test_override_lm_head_makes_the_head_a_unit():
    import shardc
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.units import find_units
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import gpt
    with torch.device("meta"):
        model = gpt.small()
    s = shardc.load_strategy('mesh gpu(4)\nparams shard over gpu\ngrads shard over gpu\noptim shard over gpu\n'
                             'override "lm_head" { optim shard over world }\n')
    units = {u.name: u for u in find_units(model, resolve_bucket(model, s))}
    assert "lm_head" in units and units["lm_head"].modules == ("lm_head",)
    # GPT-2 ties the head to the embedding: the tied weight stays in the root ([Note: tied parameters])
    assert "transformer.wte.weight" in units["<root>"].params
    assert [n for n in units if n.startswith("transformer.h.")] == [f"transformer.h.{i}" for i in range(4)]
