"""Syntax errors — lark's exceptions turned into labelled diagnostics (stage 1).

Input: an `UnexpectedInput` from the LALR parser and the source lines; output: one
`Diagnostic` naming the mistake in the user's terms ("unknown statement `parms`",
"unknown option `com` for `params`") with a "did you mean" from difflib over the
keywords the parser would have accepted at that point.

[Note: how mistakes are recognised]
Instead of lark's `match_examples` (which needs a corpus per label) we look at what the
parser expected when it stopped (`e.expected`, terminal names) and at the token it got:
statement keywords expected -> unknown statement; option keywords -> unknown option;
dtype words -> unknown dtype; and so on. Everything else falls back to
"unexpected X; expected one of ...".
"""
from __future__ import annotations

from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from shardc.dsl.diagnostics import Diagnostic, did_you_mean, error, short
from shardc.dsl.ir import STATES, Span

STATEMENTS = ("strategy", "mesh", *STATES, "accumulate", "prefetch", "collectives", "units", "bucket",
              "buffers", "override", "experts")
_NAMES = {"NAME": "a name", "INT": "a number", "STRING": "a quoted string",
          "_NL": "end of line", "$END": "end of file", "STAR": "`*`", "LOCAL": "`local`",
          "WORLD": "`world`"}
# What a name stands for, by the statement it is in (a keyword where a name belongs).
_NAME_OF = {"mesh": "a level name", "strategy": "a strategy name", "units": "a unit type name",
            "experts": "a level name", **{k: "a level name" for k in STATES}}


def describe(e: UnexpectedInput, lines: list[str], file: str, lark) -> Diagnostic:
    literals = {t.name: t.pattern.value for t in lark.terminals if t.pattern.type == "str"}
    if isinstance(e, UnexpectedCharacters):
        return _bad_character(e, lines, file)
    if isinstance(e, UnexpectedToken):
        return _bad_token(e, lines, file, literals)
    line = max(1, min(getattr(e, "line", 1) or 1, len(lines)))
    return error(Span(file, line, 1, line, 2), "unexpected end of input")


def _bad_character(e: UnexpectedCharacters, lines, file) -> Diagnostic:
    span = Span(file, e.line, e.column, e.line, e.column + 1)
    c = e.char
    if c == '"':
        return error(span, "unterminated string", 'close the string with `"` on the same line')
    if c == "-":
        return error(span, "unexpected `-`", "sizes and counts are whole numbers; "
                     "the only hyphenated word is `ho-ring`")
    shown = c if c.isprintable() else f"U+{ord(c):04X}"
    return error(span, f"unexpected character `{shown}`",
                 "names are letters, digits and `_`; patterns go in double quotes")


def _words(expected, literals) -> list[str]:
    return sorted(literals[t] for t in expected if t in literals)


def _describe_expected(expected, literals) -> str:
    names = [f"`{literals[t]}`" if t in literals else _NAMES.get(t, t) for t in sorted(expected)]
    return ", ".join(sorted(set(names)))


def _bad_token(e: UnexpectedToken, lines, file, literals) -> Diagnostic:
    tok, expected = e.token, set(e.expected)
    at_end = tok.type in ("_NL", "$END")
    line = tok.line if isinstance(tok.line, int) else len(lines)
    col = tok.column if isinstance(tok.column, int) else 1
    if tok.type == "$END":   # lark borrows the last token's position; point past the text
        line = _last_line(lines)
        col = len(lines[line - 1]) + 1 if line <= len(lines) else 1
    raw = "" if at_end else str(tok)
    span = Span(file, line, col, line, col + max(1, len(raw)))
    text = short(raw)
    stmt = short(_first_word(lines, line))
    words = _words(expected, literals)
    hint = did_you_mean(text, words) if text else None

    if "RBRACE" in expected and tok.type == "$END":
        opened = block_openers(lines)
        kind = "override"
        if opened and "{" in lines[opened[-1] - 1]:
            n = opened[-1]
            kind = _block_kind(lines, n)
            c = lines[n - 1].index("{") + 1
            span = Span(file, n, c, n, c + 1)
        return error(span, f"unclosed `{kind}` block: no `}}` before the end of the file",
                     "add a line with `}` after its statements")
    if tok.type == "RBRACE":
        return error(span, "`}` without an `override` or `experts` block", "remove it")
    if "PARAMS" in expected and tok.type not in ("_NL",):
        inside = "OVERRIDE" not in expected
        kind = _block_kind(lines, line) if inside else ""
        where = f" in an `{kind}` block" if inside else ""
        if tok.type == "NAME":
            options = STATES if inside else STATEMENTS
            return error(span, f"unknown statement `{text}`{where}",
                         did_you_mean(text, options) or f"statements are: {', '.join(options)}")
        if inside and text in STATEMENTS and text not in STATES:
            what = "an override" if kind == "override" else "an experts block"
            return error(span, f"`{text}` cannot appear in an `{kind}` block",
                         f"{what} sets only `params`, `grads` and `optim`; put it at the top level")
        if "_NL" not in expected:
            return error(span, f"expected a statement, found `{text}`{where}",
                         "each line starts with a statement keyword such as `params`")
    if stmt in BLOCKS and expected == {"STRING"}:
        h = f'quote it: `{stmt} "{short(raw, 40)}"`' if tok.type in ("NAME", "INT") else \
            'a pattern is a glob in double quotes, e.g. "layers.*.moe.experts"'
        return error(span, f"expected a quoted pattern after `{stmt}`, found {_found(tok)}", h)
    if stmt == "experts" and expected == {"INT", "NAME"} and (at_end or raw not in _reserved(literals)):
        return error(span, f"expected a number or a level name after `ep`, found {_found(tok)}",
                     "write `ep N` (N ranks of the innermost level) or `ep LEVEL` (a whole level)")
    if stmt == "experts" and "EP" in expected and tok.type in ("NAME", "INT"):
        return error(span, f"expected `ep`, `{{` or the end of the line after the pattern, found {_found(tok)}",
                     f"write `ep {short(raw)}` to split the experts over ranks")
    if "NAME" in expected and "_NL" not in expected and raw in _reserved(literals):
        return error(span, f"`{text}` is a reserved keyword and cannot be used as {_NAME_OF.get(stmt, 'a name')}",
                     f"rename it, e.g. `{text}_`; keywords are listed in the language reference")
    if text.lower() in STATEMENTS and "_NL" in expected:
        return error(span, f"`{text}` must start its own line",
                     "write one statement per line")
    if {"SECONDARY", "COMM", "DTYPE"} & expected and not at_end:
        return error(span, f"unknown option `{text}` for `{stmt}`",
                     hint or f"`{stmt}` takes: {', '.join(w for w in words if w not in ('fp32',))}")
    if "FP32" in expected:
        what = "a dtype" if tok.type != "NAME" or at_end else f"unknown dtype `{text}`"
        msg = f"expected a dtype, found {_found(tok)}" if what == "a dtype" else what
        return error(span, msg, hint or "dtypes are: fp32, bf16, fp16, int8, int4")
    if "REPLICATE" in expected:
        return error(span, f"expected a scope after `{stmt}`, found {_found(tok)}",
                     hint or "write `replicate` or `shard over LEVELS`")
    if expected == {"OVER"}:
        return error(span, f"expected `over` after `shard`, found {_found(tok)}",
                     "write `shard over LEVELS`, e.g. `shard over gpu`")
    if "WORLD" in expected:
        return error(span, f"expected mesh levels, found {_found(tok)}",
                     "write `world` or level names separated by commas, e.g. `node, gpu`")
    if stmt == "collectives" and ("NAME" in expected or "DASH" in expected):
        return error(span, f"expected a collectives algorithm, found {_found(tok)}",
                     hint or "choose auto, ring, hierarchical or ho-ring")
    if "BROADCAST" in expected:
        what = f"unknown buffers mode {_found(tok)}" if tok.type == "NAME" else \
            f"expected `broadcast` or `local` after `buffers`, found {_found(tok)}"
        return error(span, what,
                     hint or "write `buffers broadcast` (rank 0's buffers on every rank) or `buffers local`")
    if "STAR" in expected:
        return error(span, f"expected a level size, found {_found(tok)}",
                     "a size is a whole number, `*` (inferred from the world size) or `local`")
    if expected == {"NAME"}:
        return error(span, f"expected a name, found {_found(tok)}",
                     "names are letters, digits and `_`, starting with a letter")
    if expected == {"INT"}:
        return error(span, f"`{stmt}` takes a whole number, found {_found(tok)}")
    if "TYPE" in expected:
        rest = lines[line - 1][col - 1:].split("#")[0].strip() if tok.type == "NAME" else ""
        h = f'quote patterns: `units "{short(rest, 60)}"`' if rest else None
        return error(span, f"expected `auto`, quoted patterns or `type NAME` after `units`, found {_found(tok)}",
                     h or 'e.g. `units auto`, `units "transformer.h.*"` or `units type Block`')
    if "LPAR" in expected:
        return error(span, f"expected `(SIZE)` after the level name, found {_found(tok)}",
                     "write levels as `node(2) > gpu(4)`")
    if "_NL" in expected and not at_end:
        return error(span, f"unexpected {_found(tok)} at the end of the `{stmt}` statement",
                     hint or "remove it, or start a new line")
    return error(span, f"unexpected {_found(tok)}",
                 f"expected {_describe_expected(expected, literals)}")


BLOCKS = ("override", "experts")      # the statements that open a `{ ... }` block


def block_openers(lines: list[str]) -> list[int]:
    """The lines (1-based) that start with a block statement (`override`, `experts`)."""
    return [i for i, ln in enumerate(lines, 1) if ln.lstrip().startswith(BLOCKS)]


def _block_kind(lines: list[str], line: int) -> str:
    """The statement (`override` or `experts`) whose block holds `line`: the nearest opener at or above it."""
    opened = [n for n in block_openers(lines) if n <= line]
    return next(b for b in BLOCKS if lines[opened[-1] - 1].lstrip().startswith(b)) if opened else "override"


def _reserved(literals) -> set[str]:
    """The grammar's keywords (`mesh`, `broadcast`, `world`, ...): never a name."""
    return {w for w in literals.values() if w.isidentifier()}


def _found(tok) -> str:
    if tok.type == "_NL":
        return "end of line"
    if tok.type == "$END":
        return "end of file"
    return f"`{short(str(tok))}`"


def _last_line(lines: list[str]) -> int:
    for i in range(len(lines), 0, -1):
        if lines[i - 1].strip():
            return i
    return 1


def _first_word(lines: list[str], line: int) -> str:
    if not 1 <= line <= len(lines):
        return ""
    parts = lines[line - 1].split()
    return parts[0] if parts else ""
