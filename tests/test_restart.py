"""examples/train_gpt.py under `torchrun --max-restarts 1`: a rank SIGKILLed in the middle
of a step brings the job down, torchrun restarts it, it resumes from the latest
checkpoint (`--checkpoint-dir`) and ends with exactly the parameters of a run that never
stopped (same strategy and world, so bit for bit)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.distributed
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(tmp, name, kill=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("TRAIN_GPT_KILL_AT", None)
    if kill:
        env["TRAIN_GPT_KILL_AT"] = kill
    final = str(tmp / f"{name}.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
           os.path.join(ROOT, "examples", "train_gpt.py"),
           "--strategy", os.path.join(ROOT, "examples", "strategies", "zero3.shard"), "--mesh", "gpu(2)",
           "--model", "tiny", "--steps", "4", "--batch", "2", "--quiet", "--capture", "fx",
           "--checkpoint-dir", str(tmp / name), "--save-final", final]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return torch.load(final), run.stdout + run.stderr


def test_sigkilled_rank_restarts_and_matches_uninterrupted(tmp_path):
    want, _ = _torchrun(tmp_path, "clean")
    got, log = _torchrun(tmp_path, "killed", kill="1:2")
    assert "resumed from" in log and "step_000002" in log, log[-3000:]
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_resuming_from_another_models_checkpoint_is_one_sentence(tmp_path):
    # --checkpoint-dir pointed at another job's checkpoints: DCP fails on every rank (a
    # CheckpointException carrying each rank's traceback); each rank prints one line naming
    # the checkpoint and the first missing entry, and exits 1, with no traceback.
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": {"other.weight": torch.zeros(3)}, "step": 1}, checkpoint_id=str(tmp_path / "ck" / "step_000001"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("TRAIN_GPT_KILL_AT", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
           os.path.join(ROOT, "examples", "train_gpt.py"),
           "--strategy", os.path.join(ROOT, "examples", "strategies", "zero3.shard"), "--mesh", "gpu(2)",
           "--model", "tiny", "--steps", "2", "--batch", "2", "--quiet", "--capture", "fx",
           "--checkpoint-dir", str(tmp_path / "ck")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode != 0
    errors = [l for l in run.stderr.splitlines() if l.startswith("error: ")]
    assert errors, run.stderr[-3000:]
    assert f"cannot resume from {tmp_path / 'ck' / 'step_000001'}" in errors[0]
    assert "Missing key in checkpoint state_dict: model." in errors[0]
    # no worker traceback (torchrun's own launcher still prints its ChildFailedError report)
    out = run.stdout + run.stderr
    assert "CheckpointException" not in out and "train_gpt.py\", line" not in out
    assert "distributed/checkpoint/" not in out
