"""examples/train_gpt.py under `torchrun --max-restarts 1`: a rank SIGKILLed in the middle
of a step brings the job down, torchrun restarts it, it resumes from the latest
checkpoint (`--checkpoint-dir`) and ends with exactly the parameters of a run that never
stopped (same strategy and world, so bit for bit). The script survives the restart through
`shardc.distributed()`, whose restart path and exit are checked on their own below."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.distributed
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(tmp, name, kill=None):
    """Start examples/train_gpt.py under torchrun (2 ranks, one restart allowed); returns the
    running process and the path of its final parameters."""
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
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), final


def _finish(job):
    proc, final = job
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return torch.load(final), out + err


def test_sigkilled_rank_restarts_and_matches_uninterrupted(tmp_path):
    # both jobs at once (each its own rendezvous port): torchrun's start-up, rendezvous and
    # restart waits overlap instead of adding up
    clean, killed = _torchrun(tmp_path, "clean"), _torchrun(tmp_path, "killed", kill="1:2")
    want, _ = _finish(clean)
    got, log = _finish(killed)
    assert "resumed from" in log and "step_000002" in log, log[-3000:]
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_resuming_from_another_models_checkpoint_is_one_sentence(tmp_path):
    # --checkpoint-dir pointed at another job's checkpoints: DCP fails on every rank (a
    # CheckpointException carrying each rank's traceback); the first rank prints one line
    # naming the checkpoint and the first missing entry, every rank exits 1, no traceback.
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
    assert len(errors) == 1, run.stderr[-3000:]
    assert f"cannot resume: {tmp_path / 'ck' / 'step_000001'} has no entry 'model." in errors[0]
    # no worker traceback (torchrun's own launcher still prints its ChildFailedError report)
    out = run.stdout + run.stderr
    assert "CheckpointException" not in out and "train_gpt.py\", line" not in out
    assert "distributed/checkpoint/" not in out


# --- shardc.distributed(): the helper train_gpt.py and the README's loop run in ------------

JOB = """
import sys, torch.distributed as dist, shardc
from torch.distributed import distributed_c10d as c10d
with shardc.distributed("gloo"):
    c10d._get_default_store().set("probe", "1")     # lands in the agent's store, under the group's prefixes
    print(dist.get_world_size(), flush=True)
    sys.exit(int(sys.argv[1]))
print("after the block", flush=True)
"""


def _worker(code: int, attempt: int, port: int, agent_store: bool):
    """One process as torchrun starts a worker (world 1, attempt `attempt`)."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT=str(attempt), PYTHONPATH=ROOT)
    if agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return subprocess.run([sys.executable, "-c", JOB, str(code)], env=env, capture_output=True, text=True, timeout=300)


def test_distributed_helper_under_torchrun():
    # A torchrun worker: after a restart with the agent's store, its keys go under the
    # attempt's prefix; the process ends with the block and its exit status (what follows
    # the block does not run: no interpreter teardown).
    import torch.distributed as dist
    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)   # the agent's store
    for attempt, code in ((0, 0), (1, 3)):
        run = _worker(code, attempt, agent.port, agent_store=True)
        assert run.returncode == code, run.stderr
        assert run.stdout.split() == ["1"] and "Traceback" not in run.stderr   # nothing after the block ran
    probes = sorted(k for k in agent.list_keys() if k.endswith("/probe"))
    # attempt 0 as torch makes it; attempt 1 under its own prefix, apart from attempt 0's keys
    assert len(probes) == 2, probes
    assert [k.startswith("/shardc/attempt_1/") for k in probes] == [True, False], probes


def test_distributed_helper_uses_an_existing_group_and_needs_a_launcher(monkeypatch):
    # Outside torchrun: one sentence saying how to launch. On a group that exists (a test
    # harness, a script that made its own): the block runs on it, and it is left alone.
    import torch.distributed as dist

    import shardc
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(shardc.ShardcError, match=r"^shardc\.distributed\(\) runs one process per rank: launch the "
                                                 r"script with torchrun \(e\.g\. `torchrun --nproc-per-node 4"):
        with shardc.distributed():
            pass
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with shardc.distributed():
            assert dist.get_world_size() == 1
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
