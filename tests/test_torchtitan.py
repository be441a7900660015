"""torchtitan's models under shardc at parity: the parity checks of the real-client harnesses
(bench/clients/torchtitan_check.py: Llama 3; bench/clients/torchtitan_moe_check.py: DeepSeek-V3 with
torchtitan's own expert parallelism) run as tests, on 4 gloo ranks, 2 layers.

Each harness trains shardc's sharded model and one process on the concatenated batch and
passes at max(1e-5, 3 x the float32 floor) (the harnesses' docstrings say how the floor is
measured); a failing check exits 1 and prints which parameter is off. Marked `slow` (torchrun,
minutes) and skipped, with the reason, where torchtitan is not installed: it is no test
dependency (`pip install torchtitan` runs them).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason="torchtitan is not installed (no test dependency; pip install torchtitan runs these)"),
]


def _check(script: str, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(ROOT, script), *args, "--layers", "2"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"{' '.join(cmd[3:])} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def test_llama3_zero3_and_paro_iig_at_parity():
    _check("bench/clients/torchtitan_check.py", "--check", "parity", "--strategies", "zero3,paro_iig", "--steps", "2")


def test_llama3_full_state_dict_bit_equal():
    _check("bench/clients/torchtitan_check.py", "--check", "full", "--steps", "1")


def test_deepseek_v3_expert_parallel_at_parity():
    _check("bench/clients/torchtitan_moe_check.py", "--check", "parity", "--strategies", "ep2_zero3",
           "--experts-dtype", "fp32", "--steps", "2")
