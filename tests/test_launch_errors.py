"""Forgetting torchrun: one sentence that says how to launch, never torch's raw
"RANK expected, but not set" traceback (the example script, `shardc.compile`)."""
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import shardc
from tests.harness import HANG_S
from examples.gpt import example_inputs, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_gpt_without_torchrun_says_how_to_launch():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    r = subprocess.run([sys.executable, "examples/train_gpt.py", "--strategy", "examples/strategies/paro_iig.shard"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=HANG_S)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "launch it with torchrun" in r.stderr and "--nproc-per-node 4 examples/train_gpt.py" in r.stderr


def test_compile_outside_a_process_group_says_how_to_launch():
    assert not dist.is_initialized()
    m = tiny()
    with pytest.raises(shardc.ShardcError) as e:
        shardc.compile(m, os.path.join(ROOT, "examples", "strategies", "zero3.shard"), example_inputs(m),
                       mesh="node(2) > gpu(2)")
    msg = str(e.value)
    assert "launch your script with torchrun" in msg and "init_process_group()" in msg
    assert "shardc compile" in msg and "\n" not in msg
