"""docs/language.md documents every statement, shows valid examples and real diagnostics."""
from __future__ import annotations

import re

from shardc.dsl.parser import parse_program
from shardc.dsl.syntax_errors import STATEMENTS
from tests import regen_diagnostics as regen

DOC = regen.DOCS.read_text()


def test_example_diagnostics_match_goldens():
    assert DOC == regen.fill_docs(DOC), "run `python tests/regen_diagnostics.py` to refresh the docs"


def test_every_statement_has_a_section():
    for kw in STATEMENTS:
        assert re.search(rf"^### `{kw}\b", DOC, re.M), kw


def test_every_warning_and_check_family_is_shown():
    shown = set(re.findall(r"<!-- diagnostic: ([\w/]+) -->", DOC))
    assert set(regen.warning_names()) <= shown
    for family in ("dependency_", "duplicate_", "unknown_", "_replicate_comm", "product_mismatch",
                   "two_stars", "star_not_divisible", "undeclared_level", "accumulate_zero", "prefetch_negative",
                   "bucket_negative", "secondary_replicate", "control_char", "empty", "experts_ep_not_divisor",
                   "experts_scope_over_ep"):
        assert any(family in name for name in shown), family


def test_statement_examples_parse():
    section = DOC.split("## Statements", 1)[1].split("## The resolved strategy", 1)[0]
    blocks = re.findall(r"```\n(.*?)```", section, re.S)
    assert len(blocks) >= len(STATEMENTS)
    for block in blocks:
        _, diags = parse_program(block, "doc.shard")
        assert diags == [], (block, diags)


def test_the_keyword_list_is_the_grammars():
    # Every word the grammar reserves (its quoted literals: `buffers`, `broadcast`, `ho-ring`, ...)
    # is in the lexical rules' list, and the list names nothing else.
    grammar = (regen.ROOT / "grammars" / "shard.lark").read_text()
    reserved = set(re.findall(r'"([a-z][a-z0-9-]*)"', grammar))
    listed = re.search(r"^- Keywords are lower case: `([^`]*)`", DOC, re.M).group(1).split()
    assert len(listed) == len(set(listed))
    assert set(listed) == reserved, (reserved - set(listed), set(listed) - reserved)
