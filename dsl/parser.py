"""Parser — stage 1 of the pipeline (**text -> AST**).

Input: the text of a `.shard` file (or a mesh string); output: `shardc.dsl.ast.Program`
(or `MeshAst`) plus a list of `Diagnostic`s. The grammar is `grammars/shard.lark`
(package data of `shardc.grammars`), parsed by lark LALR with positions kept. No lark
Tree or Token leaves this module.

[Note: error recovery]
A syntax error is reported (labelled, see `shardc.dsl.syntax_errors`), then the
offending line is blanked — replaced by spaces so every other position stays put — and
the text is parsed again, so one run reports every broken line. The loop stops at an
error on a blank line (nothing left to remove), at the end of the file, or after
`_MAX_ERRORS` errors.

[Note: bounded meshes]
A mesh line with more than `MAX_LEVELS` levels is reported (located at the first level
too many) and blanked before lark sees it, so a hostile 50 KB mesh line is rejected in
linear time with one short error instead of being parsed, resolved and echoed level by
level.
"""
from __future__ import annotations

import functools
import importlib.resources

from lark import Lark, Transformer, v_args
from lark.exceptions import UnexpectedInput

from shardc.dsl import ast
from shardc.dsl.diagnostics import Diagnostic, error
from shardc.dsl.ir import Span
from shardc.dsl.mesh import MAX_LEVELS
from shardc.dsl.syntax_errors import block_openers, describe

_MAX_ERRORS = 20


@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    text = importlib.resources.files("shardc.grammars").joinpath("shard.lark").read_text()
    return Lark(text, parser="lalr", lexer="basic", propagate_positions=True,
                start=["start", "mesh_spec"], maybe_placeholders=False)


@functools.lru_cache(maxsize=1)
def keywords() -> frozenset[str]:
    """The grammar's reserved words (`mesh`, `shard`, `world`, ...): never usable as a name."""
    return frozenset(t.pattern.value for t in _lark().terminals
                     if t.pattern.type == "str" and t.pattern.value.isidentifier())


def parse_program(text: str, file: str) -> tuple[ast.Program, list[Diagnostic]]:
    """Parse a whole strategy file; returns the AST of the lines that parse and the errors."""
    text, diags = _scrub_control(text, file)
    lines = text.split("\n")
    skipped: list[str] = []
    for n, line in enumerate(lines, start=1):
        if line.lstrip().startswith("mesh") and _too_deep(line, file, n, diags):
            skipped.append("mesh")
            lines[n - 1] = " " * len(line)
    for _ in range(_MAX_ERRORS):
        try:
            tree = _lark().parse("\n".join(lines) + "\n", start="start")
        except UnexpectedInput as e:
            diags.append(describe(e, lines, file, _lark()))
            bad = _error_line(e, len(lines)) or _unclosed_block(e, lines)
            if bad is None or not lines[bad - 1].strip():
                break
            skipped.append(lines[bad - 1].split()[0])
            lines[bad - 1] = " " * len(lines[bad - 1])
            continue
        stmts = _ToAst(file).transform(tree)
        return ast.Program(file, tuple(stmts), tuple(skipped)), diags
    return ast.Program(file, (), tuple(skipped)), diags


def parse_mesh(text: str, file: str = "<mesh>") -> tuple[ast.MeshAst | None, list[Diagnostic]]:
    """Parse a mesh override such as `node(2) > gpu(2) > gcd(2)` (no `mesh` keyword)."""
    if "\n" in text:
        return None, [error(Span(file, 1, 1, 1, 2), "a mesh override is one line",
                            "write it as `node(2) > gpu(4)`")]
    scrubbed, diags = _scrub_control(text, file)
    if diags:
        return None, diags
    body = scrubbed.strip()
    if body.startswith("mesh "):        # tolerate a pasted `mesh ...` line
        scrubbed = scrubbed.replace("mesh", "    ", 1)
    if _too_deep(scrubbed, file, 1, diags):
        return None, diags
    try:
        tree = _lark().parse(scrubbed, start="mesh_spec")
    except UnexpectedInput as e:
        return None, [describe(e, [scrubbed], file, _lark())]
    return _ToAst(file).transform(tree), []


def _too_deep(line: str, file: str, n: int, diags: list[Diagnostic]) -> bool:
    """A mesh line of more than MAX_LEVELS levels: one error at the first extra level."""
    code = line.split("#", 1)[0]
    levels = code.count(">") + 1
    if levels <= MAX_LEVELS:
        return False
    pos = -1
    for _ in range(MAX_LEVELS):
        pos = code.index(">", pos + 1)
    col = len(code) - len(code[pos + 1:].lstrip()) + 1       # the first level too many
    diags.append(error(Span(file, n, col, n, col + 1),
                       f"the mesh has {levels} levels; at most {MAX_LEVELS} are supported",
                       "a mesh lists the levels of the hardware, outermost first, e.g. `node(8) > gpu(8)`"))
    return True


def _error_line(e: UnexpectedInput, n_lines: int) -> int | None:
    tok = getattr(e, "token", None)
    if tok is not None and tok.type == "$END":
        return None
    line = getattr(e, "line", None)
    if not isinstance(line, int) or not 1 <= line <= n_lines:
        return None
    return line


def _unclosed_block(e: UnexpectedInput, lines: list[str]) -> int | None:
    """At end of file inside an `override` or `experts` block: the line that opened it (to blank)."""
    if "RBRACE" not in getattr(e, "expected", ()):
        return None
    opened = block_openers(lines)
    return opened[-1] if opened else None


def is_control(c: str) -> bool:
    """A character a strategy file may not contain (NUL, ESC, DEL, ...; tab and CR are fine)."""
    return (ord(c) < 32 and c not in "\t\r") or ord(c) == 127


def _scrub_control(text: str, file: str) -> tuple[str, list[Diagnostic]]:
    """Report control characters (NUL, ESC, ...) once per line; replace them by spaces."""
    diags, out = [], []
    for n, line in enumerate(text.split("\n"), start=1):
        bad = [i for i, c in enumerate(line) if is_control(c)]
        if bad:
            c = line[bad[0]]
            if len(diags) < _MAX_ERRORS:
                diags.append(error(Span(file, n, bad[0] + 1, n, bad[0] + 2),
                                   f"control character U+{ord(c):04X} is not allowed",
                                   "remove it; a strategy file is plain text"))
            bad_set = set(bad)
            line = "".join(" " if i in bad_set else c for i, c in enumerate(line))
        out.append(line)
    return "\n".join(out), diags


def _span(file: str, meta) -> Span:
    return Span(file, meta.line, meta.column, meta.end_line, meta.end_column)


@v_args(meta=True)
class _ToAst(Transformer):
    """lark tree -> AST dataclasses (tokens become `Word`s with spans)."""

    def __init__(self, file: str):
        super().__init__(visit_tokens=False)
        self.file = file

    def _w(self, tok) -> ast.Word:
        return ast.Word(str(tok), Span(self.file, tok.line, tok.column, tok.end_line, tok.end_column))

    def _s(self, meta) -> Span:
        return _span(self.file, meta)

    def start(self, meta, children):
        return list(children)

    # mesh
    def mesh_spec(self, meta, children):
        return ast.MeshAst(tuple(children), self._s(meta))

    def level(self, meta, children):
        name, size = children
        return ast.LevelDecl(self._w(name), size, self._s(meta))

    def size(self, meta, children):
        return self._w(children[0])

    def mesh_stmt(self, meta, children):
        return ast.Statement("mesh", self._s(meta), mesh=children[0])

    # scopes and options
    def levels(self, meta, children):
        return tuple(self._w(t) for t in children)

    def replicate(self, meta, children):
        return ast.ScopeAst((), self._s(meta))

    def shard(self, meta, children):
        return ast.ScopeAst(children[0], self._s(meta), children[1] if len(children) > 1 else None)

    def by_clause(self, meta, children):
        return self._w(children[0])

    def dtype_word(self, meta, children):
        return self._w(children[0])

    quant = dtype_word

    def comm_opt(self, meta, children):
        return ast.Option("comm", children[0], (), self._s(meta))

    def dtype_opt(self, meta, children):
        return ast.Option("dtype", children[0], (), self._s(meta))

    def secondary_opt(self, meta, children):
        quant = children[1] if len(children) > 1 else None
        return ast.Option("secondary", quant, children[0], self._s(meta))

    def _state(self, keyword, meta, children):
        return ast.Statement(keyword, self._s(meta), scope=children[0], options=tuple(children[1:]))

    def params_stmt(self, meta, children):
        return self._state("params", meta, children)

    def grads_stmt(self, meta, children):
        return self._state("grads", meta, children)

    def optim_stmt(self, meta, children):
        return self._state("optim", meta, children)

    # simple statements
    def _words(self, keyword, meta, children, form=""):
        words = tuple(c if isinstance(c, ast.Word) else self._w(c) for c in children)
        return ast.Statement(keyword, self._s(meta), args=words, form=form)

    def strategy_stmt(self, meta, children):
        return self._words("strategy", meta, children)

    def accumulate_stmt(self, meta, children):
        return self._words("accumulate", meta, children)

    def prefetch_stmt(self, meta, children):
        return self._words("prefetch", meta, children)

    def collectives_stmt(self, meta, children):
        return self._words("collectives", meta, children)

    def algo_name(self, meta, children):
        """An algorithm's name, hyphens joined (`ho-ring`): one word spanning them."""
        first, last = children[0], children[-1]
        joined = type(first)("NAME", "".join(str(t) for t in children), first.start_pos, first.line,
                             first.column, last.end_line, last.end_column, last.end_pos)
        return self._w(joined)

    def buffers_stmt(self, meta, children):
        return self._words("buffers", meta, children)

    def buffers_mode(self, meta, children):
        return self._w(children[0])

    def bucket_stmt(self, meta, children):
        return self._words("bucket", meta, children)

    def units_auto(self, meta, children):
        return self._words("units", meta, children, form="auto")

    def units_patterns(self, meta, children):
        return self._words("units", meta, children, form="patterns")

    def units_type(self, meta, children):
        return self._words("units", meta, children, form="type")

    def override_stmt(self, meta, children):
        pattern, *body = children
        return ast.Statement("override", self._s(meta), args=(self._w(pattern),), body=tuple(body))

    def experts_stmt(self, meta, children):
        """`experts "PATTERN" [ep INT|NAME] [{ ... }]`: args = (pattern[, ep value]);
        form "block" when braces were written (even empty: an error), else ""."""
        pattern, *rest = children
        args = [self._w(pattern)]
        body, form = (), ""
        for c in rest:
            if isinstance(c, ast.Word):
                args.append(c)
            else:
                body, form = c, "block"
        return ast.Statement("experts", self._s(meta), args=tuple(args), body=body, form=form)

    def ep_clause(self, meta, children):
        return self._w(children[0])

    def experts_block(self, meta, children):
        return tuple(children)
