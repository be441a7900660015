"""Layering: the import arrows between shardc's packages, read from the source (ast).

CLI (`shardc.cli`) -> compiler -> analysis -> units -> lowering -> dsl -> algorithms;
runtime -> units -> lowering -> dsl -> algorithms; the CLI and the public API (`shardc`) sit
on top (`shardc simulate` runs the public API's `shardc.compile`; nothing in the public API
imports the CLI).
Every `import`/`from ... import` of every module (including those inside functions, and
`importlib.import_module("shardc....")` with a literal prefix) is mapped to the layer it
names; a layer may import itself and the layers `MAY_IMPORT` lists, nothing else. The
layers are pyproject.toml's packages (a module directly in `shardc`, such as `shardc.api`, is
the public API's layer `shardc`), so a new package must be placed here.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MAY_IMPORT = {
    # collective algorithms (one object each): their names, stages and pieces, read by every layer
    "algorithms": set(),
    "dsl": {"algorithms"},
    "lowering": {"dsl", "algorithms"},
    # the unit table: torch.nn, the DSL's IR and the lowering's per-unit scopes
    "units": {"lowering", "dsl", "algorithms"},
    "runtime": {"units", "lowering", "dsl", "algorithms"},
    "analysis": {"units", "lowering", "dsl", "algorithms"},
    # The compiler asks the cost model to resolve `collectives auto` and the bucket size.
    "compiler": {"analysis", "units", "lowering", "dsl", "algorithms"},
    "grammars": set(),
    # `shardc simulate` runs the public API (`shardc.compile`) as a user's script does
    "cli": {"shardc", "compiler", "analysis", "units", "lowering", "dsl", "runtime", "algorithms"},
    "shardc": {"compiler", "analysis", "units", "lowering", "dsl", "runtime", "algorithms"},    # the public API
}
# Edges against the arrows, each named (none today). A stale entry fails
# `test_known_exceptions_are_still_needed`: delete it.
KNOWN: dict[tuple[str, str], str] = {}


def layer(module: str) -> str:
    """`shardc.cli.cmd_plan` -> `cli`; `shardc` and its own modules (`shardc.api`) -> `shardc`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and ".".join(parts[:2]) in _setuptools()["packages"] else parts[0]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def modules() -> dict[str, Path]:
    """Every module of the distribution, by dotted name (from pyproject's package-dir)."""
    dirs = _setuptools()["package-dir"]
    out = {}
    for pkg, d in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):
        for path in sorted((ROOT / d).rglob("*.py")):
            rel = path.relative_to(ROOT / d).with_suffix("").parts
            name = ".".join((pkg, *rel[:-1]) + (() if rel[-1] == "__init__" else (rel[-1],)))
            out.setdefault(name, path)
    return out


def imports(name: str, path: Path, typing: bool = True, names: bool = False) -> set[str]:
    """The `shardc...` modules `path` imports (absolute names); `typing=False` leaves out
    those under `if TYPE_CHECKING:` (annotations only, never run); `names=True` adds
    `pkg.x` for every `from pkg import x` (a submodule when such a module exists)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    if not typing:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
                node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            if base == "shardc" or names:
                found |= {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                arg = arg.values[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value.rstrip("._"))
    return {m for m in found if m == "shardc" or m.startswith("shardc.")}


def edges() -> list[tuple[str, str, str]]:
    """(importing module, its layer, imported module) for every shardc import."""
    return [(name, layer(name), dep) for name, path in modules().items() for dep in sorted(imports(name, path))]


def test_every_package_is_a_known_layer():
    assert {layer(n) for n in modules()} <= set(MAY_IMPORT)
    assert {"dsl", "compiler", "analysis", "runtime", "cli"} <= {layer(n) for n in modules()}


def test_import_arrows():
    bad = [f"{mod} ({lay}) imports {dep}" for mod, lay, dep in edges()
           if layer(dep) not in MAY_IMPORT[lay] | {lay} and (lay, dep) not in KNOWN]
    assert bad == []


def test_nothing_below_the_cli_imports_it():
    assert [(m, d) for m, lay, d in edges() if layer(d) == "cli" and lay != "cli"] == []


def test_known_exceptions_are_still_needed():
    used = {(lay, dep) for _, lay, dep in edges()}
    assert set(KNOWN) - used == set()


def test_the_scan_sees_lazy_and_dynamic_imports():
    """Guards the scanner itself: a function-level import and an import_module f-string."""
    cli = modules()["shardc.cli"]
    assert "shardc.cli.cmd" in imports("shardc.cli", cli)           # f"shardc.cli.cmd_{name}"
    assert "shardc.analysis.costmodel.timing" in imports("shardc.compiler.api", modules()["shardc.compiler.api"])


def cycles() -> list[set[str]]:
    """Modules that import each other, directly or round a loop (strongly connected
    components of more than one module), counting imports that run: package `__init__`s
    (which import their submodules, and which `from pkg import sub` names) and
    `TYPE_CHECKING` imports aside; `from pkg import sub` is an import of `sub`."""
    mods = modules()
    packages = {n for n, p in mods.items() if p.name == "__init__.py"}
    graph = {n: {d for d in imports(n, p, typing=False, names=True) if d in mods and d not in packages and d != n}
             for n, p in mods.items() if n not in packages}
    reach = {n: set() for n in graph}
    for n in graph:
        todo = list(graph[n])
        while todo:
            d = todo.pop()
            if d not in reach[n]:
                reach[n].add(d)
                todo += graph[d]
    loops = {frozenset({n} | {d for d in reach[n] if n in reach[d]}) for n in graph if n in reach[n]}
    return [set(c) for c in loops]


def test_no_import_cycles():
    """A module that needs another's helper and is needed by it (the CLI's
    cmd_plan -> cmd_explain -> predict_args -> cmd_plan, over `parse_memory`) means the
    helper has no home: it belongs in a module both read."""
    assert cycles() == []


def test_the_cycle_scan_sees_a_loop(tmp_path, monkeypatch):
    """Guards `cycles()`: a loop through a lazy import and a `from pkg import sub` is
    found; a `TYPE_CHECKING` import joins no loop."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from shardc.pkg.b import g\n")
    (pkg / "b.py").write_text("from shardc.pkg import c\n")
    (pkg / "c.py").write_text("from shardc.pkg.a import f\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shardc.pkg.a import f\n")
    fake = {"shardc.pkg": pkg / "__init__.py", "shardc.pkg.a": pkg / "a.py", "shardc.pkg.b": pkg / "b.py",
            "shardc.pkg.c": pkg / "c.py", "shardc.pkg.d": pkg / "d.py"}
    monkeypatch.setitem(globals(), "modules", lambda: fake)
    assert cycles() == [{"shardc.pkg.a", "shardc.pkg.b", "shardc.pkg.c"}]
