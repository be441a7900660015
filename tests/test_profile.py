"""`shardc profile`: the bandwidth JSON, through the harness (4 ranks) and through torchrun.

The command is run as `shardc.cli.cmd_profile.main` (what the dispatcher calls,
with the same exit codes), so these tests do not depend on every other command loading."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.harness import HANG_S, dist_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _profile(rank, world, path):
    from shardc.cli.cmd_profile import main

    return main(["-o", path, "--sizes", "4KiB", "64KiB", "--mesh", "node(2) > gpu(2)",
                 "--iters", "2", "--warmup", "1"])


def _run(cmd, timeout=HANG_S, **kw) -> subprocess.CompletedProcess:
    """subprocess.run that kills the whole process group (torchrun's workers too) on timeout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _bus(op, s):
    return (s - 1) / s * (2 if op == "all_reduce" else 1)


# rank 1's stretch per (fp32 elements, call index; 0 and 4 are the two sweeps' warm-ups)
STRETCH = {(1024, 2): 1.5,                                   # 4 KiB: one run of six
           **{(2048, k): 0.2 for k in (1, 2, 3, 5, 6, 7)},   # 8 KiB: every run
           **{(4096, k): 1.0 for k in (1, 2, 3)}}            # 16 KiB: all of the first sweep


def _profile_stretched(rank, world, path):
    """[Note: a robust collective time]: rank 1 stretches some runs after the collective
    (STRETCH); 3 timed runs per entry, 2 sweeps."""
    import time

    from shardc.cli import cmd_profile

    real, calls = cmd_profile._launch, {}

    def launch(op, sm, levels, algo, bufs, C, comm):
        work, n = real(op, sm, levels, algo, bufs, C, comm), bufs[0].numel()
        k = calls[n] = calls.get(n, -1) + 1
        delay = STRETCH.get((n, k), 0.0) if rank == 1 else 0.0

        class Stretched:
            def wait(self):
                work.wait()
                time.sleep(delay)
        return Stretched()

    cmd_profile._launch = launch
    try:
        return cmd_profile.main(["-o", path, "--sizes", "4KiB", "8KiB", "16KiB", "--mesh", "gpu(2)",
                                 "--ops", "all_gather", "--iters", "3", "--warmup", "1", "--sweeps", "2"])
    finally:
        cmd_profile._launch = real


@pytest.mark.distributed
def test_profile_seconds_are_the_median_run_of_the_slowest_rank_over_the_sweeps(tmp_path):
    path = str(tmp_path / "bw.json")
    assert dist_run(2, _profile_stretched, path) == [0, 0]
    sec = {e["bytes"]: e["seconds"] for e in json.load(open(path))["entries"]}
    assert sec[4096] < 0.2          # one stretched run of six: the median drops it (the mean is >= 0.25)
    assert sec[8192] >= 0.2         # every run of rank 1 stretched: the slowest rank counts
    # the first sweep's three runs stretched by 1 s, the second's not: the median of the
    # six pooled runs lies between (about 0.5 s); either sweep alone would give ~0 or >= 1
    assert 0.4 < sec[16384] < 0.95


@pytest.mark.distributed
def test_profile_json_on_4_ranks(tmp_path):
    path = str(tmp_path / "bw.json")
    assert dist_run(4, _profile, path) == [0, 0, 0, 0]
    data = json.load(open(path))
    assert data["mesh"] == [{"name": "node", "size": 2}, {"name": "gpu", "size": 2}]
    assert data["device"] == "cpu"
    got = {(e["op"], tuple(e["levels"]), e["algo"], e["bytes"]) for e in data["entries"]}
    ops = ("all_gather", "reduce_scatter", "all_reduce")
    want = {(op, lv, "ring", b) for op in ops for lv in [("node",), ("gpu",)] for b in (4096, 65536)}
    want |= {(op, ("node", "gpu"), a, b) for op in ops for a in ("ring", "hierarchical", "ho-ring")
             for b in (4096, 65536)}
    assert got == want and len(data["entries"]) == 2 * 3 * 2 + 3 * 3 * 2
    for e in data["entries"]:
        s = 4 if len(e["levels"]) == 2 else 2
        assert e["seconds"] > 0
        assert e["busbw"] == pytest.approx(e["bytes"] / e["seconds"] * _bus(e["op"], s))


@pytest.mark.distributed
def test_profile_under_torchrun(tmp_path):
    path = tmp_path / "bw.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    r = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "shardc.cli.cmd_profile", "-o", str(path), "--sizes", "1KiB", "--iters", "1"],
             env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["mesh"] == [{"name": "gpu", "size": 2}]     # default: gpu(LOCAL_WORLD_SIZE) on one node
    assert sorted(e["op"] for e in data["entries"]) == ["all_gather", "all_reduce", "reduce_scatter"]
    assert all(e["bytes"] == 1024 and e["seconds"] > 0 and e["busbw"] > 0 for e in data["entries"])


def test_profile_outside_torchrun_is_a_clear_error(tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    from shardc.cli.cmd_profile import main

    assert not dist.is_initialized()              # the pytest process never joins a world
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main(["-o", str(tmp_path / "x.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: shardc profile measures a running world") and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def test_profile_bad_size_is_a_usage_error(capsys):
    from shardc.cli.cmd_profile import main

    with pytest.raises(SystemExit) as e:
        main(["-o", "x.json", "--sizes", "lots"])
    assert e.value.code == 2
    assert "expected a size such as 4096, 64KiB or 16MB" in capsys.readouterr().err
