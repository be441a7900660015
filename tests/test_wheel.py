"""Packaging: the wheel ships the grammar, templates and every subpackage.

WHEEL TEST (about 20-40 s, no network): copies the package sources and pyproject to a
temporary directory, runs `pip wheel <copy> --no-deps --no-build-isolation`, creates a
fresh venv that sees this interpreter's packages through a plain path entry (torch, lark,
... are reused, not reinstalled; the editable install's import hook is not),
installs the wheel there with `--no-deps`, then runs that venv's `shardc check
examples/strategies/paro_iig.shard --world 8 --json` with the temporary directory as
working directory, so nothing can come from the source tree; then `shardc compile` and
`shardc explain` from the same venv (templates, passes, the cli and analysis packages must ship).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.harness import HANG_S

ROOT = Path(__file__).resolve().parent.parent


def _package_dirs() -> list[str]:
    """The top-level source directories pyproject maps packages to (its package-dir owns the list)."""
    import tomllib
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return sorted({d.split("/")[0] for d in dirs.values()})


def _copy_sources(dst: Path) -> None:
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, dst / name)
    for pkg in _package_dirs():
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _see_system_packages_only(py: Path) -> None:
    """Let the venv import torch, lark, ... from this interpreter's site-packages through a
    plain path entry. `--system-site-packages` would also run that directory's .pth files,
    among them the editable install's import hook, which maps every `shardc.*` name back to
    the source tree and would hide a subpackage missing from the wheel."""
    import sysconfig
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    import site as site_mod             # a venv made with --system-site-packages: its base's too
    dirs = dict.fromkeys([sysconfig.get_paths()["purelib"], *site_mod.getsitepackages()])
    Path(site, "system_packages.pth").write_text("".join(d + "\n" for d in dirs))


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, **kw)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r


def test_wheel_ships_grammar_and_cli_runs_outside_the_repo(tmp_path):
    src, wheels, venv = tmp_path / "src", tmp_path / "wheels", tmp_path / "venv"
    src.mkdir()
    _copy_sources(src)
    _run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
          "-q", "-w", str(wheels)], cwd=tmp_path)
    (wheel,) = wheels.glob("shardc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "shardc/grammars/shard.lark" in names
    for t in (ROOT / "compiler" / "templates").glob("*.jinja"):
        assert f"shardc/compiler/templates/{t.name}" in names

    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py, exe = venv / "bin" / "python", venv / "bin" / "shardc"
    _see_system_packages_only(py)
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], cwd=tmp_path)

    env = dict(os.environ, LOCAL_WORLD_SIZE="4")
    env.pop("PYTHONPATH", None)
    where = _run([str(py), "-c", "import shardc.grammars as g; print(g.__file__)"], cwd=tmp_path, env=env)
    assert where.stdout.strip().startswith(str(venv)), "the venv must import the installed wheel"
    example = ROOT / "examples" / "strategies" / "paro_iig.shard"
    code = f"import shardc; print(shardc.load_strategy({str(example)!r}, world_size=8).optim.levels)"
    api = _run([str(py), "-c", code], cwd=tmp_path, env=env)
    assert api.stdout.strip() == "('node', 'gpu')"

    r = subprocess.run([str(exe), "check", str(example),
                        "--world", "8", "--json"], capture_output=True, text=True, timeout=HANG_S,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["name"] == "paro_iig"
    assert data["mesh"] == [{"name": "node", "size": 2}, {"name": "gpu", "size": 4}]
    assert (data["params"]["levels"], data["grads"]["levels"], data["optim"]["levels"]) == (
        ["gpu"], ["gpu"], ["node", "gpu"])
    assert (data["params"]["factor"], data["grads"]["factor"], data["optim"]["factor"]) == (4, 4, 8)
    assert data["accumulate"] == 4 and data["warnings"] == []

    # The compiler's subpackages (passes) and templates, the cli and the analysis package
    # (costmodel) ship too: compile and explain run from the installed wheel, outside the repo.
    gpt = ROOT / "examples" / "gpt.py"
    out = tmp_path / "gpt_zero3.py"
    r = subprocess.run([str(exe), "compile", str(ROOT / "examples" / "strategies" / "zero3.shard"),
                        "--model", f"{gpt}:tiny", "--mesh", "node(2) > gpu(2)", "-o", str(out)],
                       capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    compile(out.read_text(), str(out), "exec")
    assert ("def shard_model(model, mesh=None, schedule=SCHEDULE, timeout=None, lowering=None, init=None, device=None,"
            in out.read_text())
    r = subprocess.run([str(exe), "explain", str(example), "--model", f"{gpt}:tiny",
                        "--mesh", "node(2) > gpu(2)", "--json"],
                       capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)["memory"]) >= {"params", "params_secondary", "grads", "optim", "total"}
