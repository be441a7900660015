"""Broken strategy files give exactly their golden diagnostics (line:col, message, caret).

Each tests/corpus/<name>.shard must fail to load (world 8, LOCAL_WORLD_SIZE=4, loaded
from the repository root) with the rendered text in tests/golden/diagnostics/<name>.txt.
A corpus file without a golden fails; regenerate with `python tests/regen_diagnostics.py`
and review the diff.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import regen_diagnostics as regen

ROOT = Path(__file__).resolve().parent.parent
NAMES = regen.names()
WARNINGS = regen.warning_names()


def test_corpus_is_large_enough():
    assert len(NAMES) >= 25


@pytest.mark.parametrize("name", NAMES)
def test_golden_diagnostics(name):
    golden = regen.GOLDEN / f"{name}.txt"
    assert golden.exists(), f"missing golden {golden}; run `python tests/regen_diagnostics.py`"
    assert regen.render(name) == golden.read_text()


def test_no_stale_goldens():
    assert sorted(p.stem for p in regen.GOLDEN.glob("*.txt")) == NAMES
    assert sorted(f"warnings/{p.stem}" for p in (regen.GOLDEN / "warnings").glob("*.txt")) == WARNINGS


@pytest.mark.parametrize("name", WARNINGS)
def test_golden_warnings(name):
    """Files under corpus/warnings load (exit 0) with exactly their golden warnings."""
    golden = regen.GOLDEN / f"{name}.txt"
    assert golden.exists(), f"missing golden {golden}; run `python tests/regen_diagnostics.py`"
    text = regen.render(name)
    assert text == golden.read_text()
    assert all(b.startswith("warning: ") for b in text.strip().split("\n\n"))


@pytest.mark.parametrize("name", NAMES)
def test_every_diagnostic_locates_and_helps(name):
    text = regen.render(name)
    blocks = [b for b in text.strip().split("\n\n") if b]
    assert blocks and all(b.startswith("error: ") for b in blocks)
    for block in blocks:
        loc = re.search(r"--> tests/corpus/(\w+)\.shard:(\d+):(\d+)", block)
        assert loc is not None and loc.group(1) == name
        assert "= help: " in block
        line, col = int(loc.group(2)), int(loc.group(3))
        source = (ROOT / "tests" / "corpus" / f"{name}.shard").read_text(errors="replace").split("\n")
        caret = next(ln for ln in block.split("\n") if ln.strip().startswith("|") and "^" in ln)
        assert caret.index("^") - caret.index("|") - 2 == col - 1
        shown = f"{line} | "
        assert any(ln.lstrip().startswith(shown) for ln in block.split("\n")) or not source[line - 1].strip()


def test_selected_messages():
    """Spot checks of the wording the language reference promises."""
    assert "did you mean `params`?" in regen.render("unknown_statement")
    dep = regen.render("dependency_params_grads")
    assert "`grads` (line 3)" in dep and "`params` (line 2)" in dep
    assert "2 × 2 = 4 ranks but the world size is 8" in regen.render("product_mismatch")
    many = regen.render("many_errors")
    assert many.count("error: ") == 5
