"""Strategy AST — stage 1 of the pipeline (text -> **AST** -> Strategy).

Input: the lark parse tree (converted in `shardc.dsl.parser`); output: these frozen
dataclasses, every node carrying the `Span` of its source text. Nothing here has been
checked beyond the grammar: sizes may be negative, levels undeclared, statements
duplicated. `shardc.dsl.resolve` turns a `Program` into a `Strategy`.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardc.dsl.ir import Span


@dataclass(frozen=True, slots=True)
class Word:
    """An identifier, keyword value, number or string, with where it was written."""
    text: str
    span: Span


@dataclass(frozen=True, slots=True)
class LevelDecl:
    name: Word
    size: Word                        # text is digits (maybe "-3"), "*" or "local"
    span: Span


@dataclass(frozen=True, slots=True)
class MeshAst:
    levels: tuple[LevelDecl, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class ScopeAst:
    """`replicate` (levels == ()) or `shard over LEVELS [by WORD]`; `world` is kept as a Word.
    `by`: the granularity word after `by` (`tensor`), or None (element-wise chunks)."""
    levels: tuple[Word, ...]
    span: Span
    by: Word | None = None

    @property
    def replicate(self) -> bool:
        return not self.levels


@dataclass(frozen=True, slots=True)
class Option:
    """One option after a scope: `comm int8`, `dtype bf16`, `secondary gpu, gcd int8`."""
    key: str                          # "comm" | "dtype" | "secondary"
    value: Word | None                # dtype word, or the secondary quantization (or None)
    levels: tuple[Word, ...]          # secondary levels (empty for comm/dtype)
    span: Span


@dataclass(frozen=True, slots=True)
class Statement:
    """A top-level (or override-block) statement.

    keyword: "strategy", "mesh", "params", "grads", "optim", "accumulate", "prefetch",
    "collectives", "units", "bucket", "buffers", "override", "experts". `args` holds the
    plain words (a name, a number and its unit, patterns, type names, the algorithm; for
    `experts` the pattern and, when written, ep's number or level); `scope`, `options`,
    `mesh`, `body` the structured parts.
    """
    keyword: str
    span: Span
    args: tuple[Word, ...] = ()
    scope: ScopeAst | None = None
    options: tuple[Option, ...] = ()
    mesh: MeshAst | None = None
    body: tuple["Statement", ...] = ()
    form: str = ""                    # units: "auto" | "patterns" | "type"; experts: "block" when braced

    @property
    def keyword_span(self) -> Span:
        s = self.span
        return Span(s.file, s.line, s.col, s.line, s.col + len(self.keyword))


@dataclass(frozen=True, slots=True)
class Program:
    file: str
    statements: tuple[Statement, ...]
    skipped: tuple[str, ...] = ()     # first words of lines dropped after a syntax error
