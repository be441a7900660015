"""Packaging: the wheel ships the grammar (and templates) as package data.

WHEEL TEST (about 20-40 s, no network): copies the package sources and pyproject to a
temporary directory, runs `pip wheel <copy> --no-deps --no-build-isolation`, creates a
fresh venv with `--system-site-packages` (torch, lark, ... are reused, not reinstalled),
installs the wheel there with `--no-deps`, then runs that venv's `shardc check
examples/strategies/paro_iig.shard --world 8 --json` with the temporary directory as
working directory, so nothing can come from the source tree.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shardc", "dsl", "compiler", "runtime", "grammars")


def _copy_sources(dst: Path) -> None:
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, dst / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kw)
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

    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    py, exe = venv / "bin" / "python", venv / "bin" / "shardc"
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
                        "--world", "8", "--json"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["name"] == "paro_iig"
    assert data["mesh"] == [{"name": "node", "size": 2}, {"name": "gpu", "size": 4}]
    assert (data["params"]["levels"], data["grads"]["levels"], data["optim"]["levels"]) == (
        ["gpu"], ["gpu"], ["node", "gpu"])
    assert (data["params"]["factor"], data["grads"]["factor"], data["optim"]["factor"]) == (4, 4, 8)
    assert data["accumulate"] == 4 and data["warnings"] == []
