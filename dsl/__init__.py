"""shardc.dsl — the strategy language: text -> AST -> checked `Strategy` IR.

`load_strategy(path_or_text, world_size=None, mesh=None)` is the entry point (also
exported as `shardc.load_strategy`); `unparse(strategy)` writes a Strategy back as text. It never raises anything but `StrategyError`
(a `ShardcError` carrying rustc-style diagnostics) for bad input.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from shardc.dsl.diagnostics import Diagnostic, Severity, StrategyError, render_all, short
from shardc.dsl.ast import Word
from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Mesh, MeshDims, Span, Strategy
from shardc.dsl.unparse import unparse

__all__ = ["load_strategy", "parse_mesh_text", "unparse", "StrategyError", "Diagnostic", "Severity", "ShardcError"]

MAX_BYTES = 100_000     # a strategy is a dozen lines; refuse megabytes of text
TEXT_NAME = "unnamed"   # the name of strategy text without a `strategy` line (a keyword would not unparse)
# The shipped strategies: files of the source tree (examples/ is not package data), named in
# the error for a strategy given by name; absent from an installed wheel.
SHIPPED = Path(__file__).resolve().parent.parent / "examples" / "strategies"


def load_strategy(path_or_text, world_size: int | None = None, mesh: str | Mesh | MeshDims | None = None,
                  ep: int | str | None = None) -> Strategy:
    """Parse, resolve and check a strategy (a path, or the text itself); `ep` (a number or
    a level name, `--ep`) replaces the `experts` statement's ep, checked as if written there."""
    text, file, default_name = _read(path_or_text)
    return load_text(text, file, default_name, world_size=world_size, mesh=mesh, ep=ep)


def load_text(text: str, file: str = "<string>", default_name: str = TEXT_NAME, *,
              world_size: int | None = None, mesh: str | Mesh | MeshDims | None = None,
              ep: int | str | None = None) -> Strategy:
    from shardc.dsl.parser import parse_program
    from shardc.dsl.resolve import MeshOverride, resolve

    sources = {file: text}
    diags: list[Diagnostic] = []
    if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1):
        raise ShardcError(f"world size must be a positive integer, got {world_size!r}")
    override = None
    if mesh is not None:
        override, mesh_diags = _mesh_override(mesh)
        diags += mesh_diags
        sources["<mesh>"] = mesh if isinstance(mesh, str) else str(mesh)
    if len(text) > MAX_BYTES:
        diags.append(_too_big(file, len(text)))
        raise StrategyError(diags, sources)
    program, parse_diags = parse_program(text, file)
    diags += parse_diags
    ep_word = None
    if ep is not None:
        sources["<ep>"] = str(ep)
        ep_word = Word(str(ep), Span("<ep>", 1, 1, 1, len(str(ep)) + 1))
    strategy, resolve_diags = resolve(program, world_size, override, default_name,
                                      parse_failed=any(d.is_error for d in diags), ep=ep_word)
    diags += resolve_diags
    if strategy is None or any(d.is_error for d in diags):
        raise StrategyError(diags, sources)
    warnings = tuple(d.render(sources) for d in diags if not d.is_error)
    return dataclasses.replace(strategy, warnings=warnings)


def parse_mesh_text(text: str, world_size: int | None = None) -> Mesh:
    """A mesh string such as `node(2) > gpu(4)` as an `ir.Mesh` (`*` needs the world size)."""
    from shardc.dsl.mesh import resolve_mesh
    from shardc.dsl.parser import parse_mesh

    tree, diags = parse_mesh(text)
    m = resolve_mesh(tree, world_size, diags) if tree is not None else None
    if m is None or any(d.is_error for d in diags):
        raise StrategyError(diags, {"<mesh>": text})
    return m


def _mesh_override(mesh):
    from shardc.dsl.parser import parse_mesh
    from shardc.dsl.resolve import MeshOverride

    if isinstance(mesh, Mesh):
        return MeshOverride(mesh=mesh), []
    if isinstance(mesh, MeshDims):
        return MeshOverride(dims=mesh), []
    if not isinstance(mesh, str):
        raise ShardcError(f"mesh must be a string such as 'node(2) > gpu(4)', a DeviceMesh or an ir.Mesh, "
                          f"got {type(mesh).__name__}")
    tree, diags = parse_mesh(mesh)
    return MeshOverride(tree=tree), diags


def _too_big(file: str, n: int) -> Diagnostic:
    from shardc.dsl.diagnostics import error
    return error(Span(file, 1, 1, 1, 1), f"the strategy file is {n} characters long, more than the {MAX_BYTES} allowed",
                 "a strategy is a few lines of text; is this the right file?")


def _read(path_or_text) -> tuple[str, str, str]:
    """(text, file name for diagnostics, default strategy name)."""
    if isinstance(path_or_text, os.PathLike) or (
            isinstance(path_or_text, str) and "\n" not in path_or_text
            and (path_or_text.endswith(".shard") or os.path.isfile(path_or_text))):
        path = Path(path_or_text)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ShardcError(f"no such strategy file: {path}") from None
        except OSError as e:
            raise ShardcError(f"cannot read strategy file {path}: {e.strerror or e}") from None
        return _decode(data, str(path)), str(path), name_of_stem(path.stem)
    if not isinstance(path_or_text, str):
        raise ShardcError(f"expected a path or the text of a strategy, got {type(path_or_text).__name__}")
    if len(path_or_text.split()) == 1 and "\n" not in path_or_text:
        raise ShardcError(_not_a_file(path_or_text.strip()))
    return path_or_text, "<string>", TEXT_NAME


def name_of_stem(stem: str) -> str:
    """The name of a strategy without a `strategy` line: the file's stem made a name the
    language accepts (`my-plan` -> `my_plan`, `mesh` -> `mesh_`), so that every loaded
    strategy unparses (dsl/unparse.py) and reads back the same."""
    from shardc.dsl.parser import keywords
    name = re.sub(r"[^A-Za-z0-9_]", "_", stem)
    if not name or name[0].isdigit():
        name = "_" + name
    return name + "_" if name in keywords() else name


def _not_a_file(word: str) -> str:
    """One word, no newline, no such file: a strategy named as if shardc resolved names
    (`shardc.compile(m, "zero3")`). The shipped strategies are files of the repository's
    examples/strategies/, not package data, so the message names them."""
    shipped = sorted(p.stem for p in SHIPPED.glob("*.shard")) if SHIPPED.is_dir() else []
    if word in shipped:
        hint = f"the shipped `{word}` is the file {SHIPPED / (word + '.shard')}; pass that path"
    elif shipped:
        hint = f"the shipped strategies are files in {SHIPPED} ({', '.join(shipped)}); pass a path"
    else:
        hint = "the shipped strategies are files in examples/strategies/ of the shardc repository; pass a path"
    return f"no strategy file `{short(word)}` (and it is not .shard text): {hint}, or the strategy's text"


def _decode(data: bytes, file: str) -> str:
    try:
        return data.decode("utf-8-sig")      # a leading byte-order mark is not text
    except UnicodeDecodeError as e:
        before = data[:e.start]
        line = before.count(b"\n") + 1
        col = len(before.rsplit(b"\n", 1)[-1].decode("utf-8", "replace")) + 1
        from shardc.dsl.diagnostics import error
        d = error(Span(file, line, col, line, col + 1), f"the file is not UTF-8 text (byte 0x{data[e.start]:02x})",
                  "a strategy file is plain text")
        raise StrategyError([d], {file: data.decode("utf-8", "replace")}) from None
