"""Load a bench/ script (bench/ is not a package) as a module, for the bench tests: `load_bench("models")`
is bench/models.py, `load_bench("peers/systems")` a file in one of bench/'s folders."""
from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def load_bench(name: str):
    """bench/NAME.py as a fresh module (NAME may name a folder: `peers/systems`); bench/ goes on
    sys.path for its imports (`from models import ...`, `from peers.systems import ...`)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(f"bench_{name.replace('/', '_')}", os.path.join(BENCH, *f"{name}.py".split("/")))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
