"""Regenerate the emitted-module goldens: `python tests/regen_emitted.py`.

Each golden is the exact text `shardc compile` writes for examples/gpt.py:tiny under one
shipped strategy (fx capture, mesh override below). Review the diff before committing.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GOLDEN_DIR = os.path.join(ROOT, "tests", "golden", "emitted")
CASES = {  # golden name -> (strategy file, mesh override)
    "gpt_tiny_zero3": ("zero3.shard", "node(2) > gpu(2)"),
    "gpt_tiny_paro_iig": ("paro_iig.shard", "node(2) > gpu(2)"),
    "gpt_tiny_zero_topo": ("zero_topo.shard", "node(2) > gpu(2) > gcd(2)"),
}


def emitted(name: str) -> str:
    from examples.gpt import tiny
    from shardc.compiler.api import compile_source

    file, mesh = CASES[name]
    source, _ = compile_source(tiny(), os.path.join(ROOT, "examples", "strategies", file), capture="fx", mesh=mesh)
    return source


def main() -> int:
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    for name in CASES:
        path = os.path.join(GOLDEN_DIR, f"{name}.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(emitted(name))
        print(f"wrote {os.path.relpath(path, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
