"""Diagnostics of the strategy language — values, rendered rustc-style.

Input: the severity, span, message and hint produced by the parser (`shardc.dsl.parser`)
and the checks (`shardc.dsl.resolve`); output: text such as

    error: unknown statement `parms`
     --> bad.shard:2:1
      |
    2 | parms shard over gpu
      | ^^^^^
      |
      = help: did you mean `params`?

A failing load raises `StrategyError` (a `ShardcError`) carrying every diagnostic of
the run; its `str()` is the rendered text.

[Note: columns]
Spans are 1-based and count characters, end exclusive. When a source line is shown,
tabs and other control characters are displayed as one space each so the caret stays
under the span's characters.
"""
from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Span


class Severity(enum.Enum):
    ERROR = "error"
    WARNING = "warning"

    def __repr__(self) -> str:
        return f"Severity.{self.name}"


@dataclass(frozen=True, slots=True)
class Note:
    """A secondary place the diagnostic refers to (e.g. the other statement)."""
    span: Span
    message: str


@dataclass(frozen=True, slots=True)
class Diagnostic:
    severity: Severity
    span: Span | None
    message: str
    hint: str | None = None
    notes: tuple[Note, ...] = ()

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def render(self, sources: dict[str, str] | None = None) -> str:
        """rustc-style text; `sources` maps a span's file name to its text."""
        sources = sources or {}
        out = [f"{self.severity.value}: {self.message}"]
        gutter = _gutter_width(self)
        if self.span is not None:
            out += _snippet(self.span, sources.get(self.span.file), gutter, "^")
        for note in self.notes:
            out.append(f"{' ' * gutter}= note: {note.message}")
            out += _snippet(note.span, sources.get(note.span.file), gutter, "-")
        if self.hint:
            out.append(f"{' ' * gutter}= help: {self.hint}")
        return "\n".join(out)


def error(span, message, hint=None, notes=()) -> Diagnostic:
    return Diagnostic(Severity.ERROR, span, message, hint, tuple(notes))


def warning(span, message, hint=None, notes=()) -> Diagnostic:
    return Diagnostic(Severity.WARNING, span, message, hint, tuple(notes))


def did_you_mean(word: str, choices) -> str | None:
    """`did you mean `x`?` for the closest choice, or None (difflib)."""
    by_lower = {c.lower(): c for c in sorted(set(choices), reverse=True)}
    close = difflib.get_close_matches(word.lower(), sorted(by_lower), n=1, cutoff=0.6)
    return f"did you mean `{by_lower[close[0]]}`?" if close else None


def _gutter_width(d: Diagnostic) -> int:
    spans = ([d.span] if d.span else []) + [n.span for n in d.notes]
    return max((len(str(s.line)) for s in spans), default=0) + 1


def _display(line: str) -> str:
    return "".join(" " if (ord(c) < 32 or ord(c) == 127) else c for c in line)


def _snippet(span: Span, source: str | None, gutter: int, mark: str) -> list[str]:
    pad = " " * gutter
    out = [f"{pad[:-1]}--> {span}"]
    lines = source.split("\n") if source is not None else []
    if not (1 <= span.line <= len(lines)):
        return out
    text = _display(lines[span.line - 1])
    end = span.end_col if span.end_line == span.line else len(text) + 1
    width = max(1, min(end, len(text) + 1) - span.col)
    col = span.col
    if len(text) > _WINDOW:             # show a window of a long line around the span
        start = max(0, col - 1 - _WINDOW // 3)
        shown = text[start:start + _WINDOW]
        text = ("..." if start else "") + shown + ("..." if start + _WINDOW < len(text) else "")
        col = col - start + (3 if start else 0)
        width = max(1, min(width, len(shown) + 1 - (col - (3 if start else 0) - 1)))
    out.append(f"{pad}|")
    out.append(f"{str(span.line).rjust(gutter - 1)} | {text}".rstrip())
    out.append(f"{pad}| {' ' * (col - 1)}{mark * width}")
    return out


_WINDOW = 100


def short(text: str, limit: int = 24) -> str:
    """`text` cut to `limit` characters for a message."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


MAX_SHOWN = 50


def render_all(diagnostics, sources: dict[str, str] | None = None) -> str:
    """Errors first in source order, then warnings, blank-line separated (at most MAX_SHOWN)."""
    ds = sort(diagnostics)
    text = "\n\n".join(d.render(sources) for d in ds[:MAX_SHOWN])
    if len(ds) > MAX_SHOWN:
        text += f"\n\n... and {len(ds) - MAX_SHOWN} more diagnostics"
    return text


def sort(diagnostics) -> list[Diagnostic]:
    def key(d: Diagnostic):
        s = d.span
        return (not d.is_error, s.line if s else 0, s.col if s else 0)
    return sorted(diagnostics, key=key)


class StrategyError(ShardcError):
    """A strategy that does not load: carries every diagnostic; str() is the rendered text."""

    def __init__(self, diagnostics, sources: dict[str, str] | None = None):
        self.diagnostics = tuple(sort(diagnostics))
        self.sources = dict(sources or {})
        super().__init__(self.rendered())

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.is_error)

    def rendered(self) -> str:
        return render_all(self.diagnostics, self.sources)

    def __str__(self) -> str:
        return self.rendered()
