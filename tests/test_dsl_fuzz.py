"""Hypothesis fuzzing of the strategy language: any text is a Strategy or a StrategyError.

Random text over an alphabet rich in the language's own words and symbols (plus control
characters, NUL, unicode), and random mutations (delete / duplicate / swap / insert /
replace a character or word) of the twelve shipped examples and a MoE strategy, each
loaded with and without a world size and a mesh override. Nothing else may be raised, rendering the
error must work, and every run is bounded (small inputs, a per-example deadline).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardc.dsl import StrategyError, load_text
from shardc.dsl.ir import Strategy

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples" / "strategies").glob("*.shard"))
# The shipped examples and a MoE strategy, so mutations reach the `experts` statement and its block.
MOE = """mesh node(*) > gpu(local)
params shard over gpu
grads  shard over gpu
optim  shard over world
experts "layers.*.moe.experts" ep 2 {
    params replicate
    grads  shard over gpu
    optim  shard over world
}
"""
TEXTS = [p.read_text() for p in EXAMPLES] + [MOE]
WORDS = ["strategy", "mesh", "params", "grads", "optim", "accumulate", "prefetch", "collectives",
         "units", "bucket", "override", "experts", "ep", "shard", "over", "replicate", "world", "secondary", "comm",
         "dtype", "int8", "int4", "bf16", "fp16", "fp32", "auto", "ring", "hierarchical", "ho-ring",
         "type", "local", "node", "gpu", "gcd", "*", ">", "(", ")", "{", "}", ",", "\n", " ", "\t",
         "#", '"', "25MB", "0", "-1", "4", "99999999999999999999999", "\x00", "\x1b", "\r", "é", "✓"]
# SHARDC_FUZZ_EXAMPLES=5000 runs a longer, randomised campaign (the default is reproducible).
_N = int(os.environ.get("SHARDC_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_N or 250, deadline=2000, derandomize=not _N, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def _load(text, **kw):
    try:
        s = load_text(text, "fuzz.shard", **kw)
    except StrategyError as e:
        assert str(e).startswith("error: ") and e.errors
        return None
    assert isinstance(s, Strategy)
    return s


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")


@FUZZ
@given(st.lists(st.sampled_from(WORDS), max_size=60))
def test_random_word_soup(words):
    text = " ".join(words)
    _load(text, world_size=8)
    _load(text)


@FUZZ
@given(st.text(max_size=300))
def test_random_text(text):
    _load(text, world_size=8)


@st.composite
def mutated(draw):
    text = draw(st.sampled_from(TEXTS))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["delete", "dup", "insert", "replace", "swap_lines", "word"]))
        i = draw(st.integers(0, max(0, len(text) - 1)))
        j = min(len(text), i + draw(st.integers(1, 12)))
        if kind == "delete":
            text = text[:i] + text[j:]
        elif kind == "dup":
            text = text[:j] + text[i:j] + text[j:]
        elif kind == "insert":
            text = text[:i] + draw(st.sampled_from(WORDS)) + text[i:]
        elif kind == "replace":
            text = text[:i] + draw(st.text(max_size=3)) + text[j:]
        elif kind == "word":
            text = text[:i] + " " + draw(st.sampled_from(WORDS)) + " " + text[j:]
        else:
            lines = text.split("\n")
            a, b = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            lines[a], lines[b] = lines[b], lines[a]
            text = "\n".join(lines)
    return text


@FUZZ
@given(mutated(), st.sampled_from([None, 1, 8, 12]), st.sampled_from([None, "node(2) > gpu(2) > gcd(2)", "a(2) >"]))
def test_mutated_examples(text, world, mesh):
    _load(text, world_size=world, mesh=mesh)


def test_examples_unmutated_load():
    for text in TEXTS:
        assert _load(text, world_size=16) is not None


@pytest.mark.parametrize("text", ["parms x\n" * 12000, "\x00\n" * 40000, "(" * 99000,
                                  'override "a" {\n' * 6000, "1" * 99999, "x" * 200_000],
                         ids=["bad-lines", "nul-lines", "parens", "open-blocks", "digits", "oversize"])
def test_large_hostile_inputs_are_bounded(text):
    import time
    t0 = time.perf_counter()
    with pytest.raises(StrategyError) as e:
        load_text(text, "big.shard", world_size=8)
    assert len(str(e.value)) < 20_000          # at most 50 diagnostics are rendered
    assert time.perf_counter() - t0 < 10
