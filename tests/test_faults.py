"""A dead or stuck peer gives every surviving rank a clear error naming the collective and
the unit (and the peer, when its process is known to be gone), within the shardc timeout,
instead of a raw gloo error or gloo's 30-minute wait. Ranks are plain processes here (not
tests/harness.py pools, whose job-end barrier a dead rank would block)."""
from __future__ import annotations

import copy
import multiprocessing as mp
import os
import signal
import socket
import time

import pytest

pytestmark = pytest.mark.distributed
WORLD = 3


def _rank(rank, port, mode, out, done):
    os.environ.update(OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    from shardc.runtime import shard_module
    from tests.test_runtime_util import Tiny, batches, loss_fn, make_opt, strategy, units_for
    model = Tiny()
    s = strategy("zero3", f"gpu({WORLD})", accumulate=1)
    sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes), timeout=5)
    opt = make_opt("adamw", sm)
    data = batches(3, WORLD, 1)
    start = time.monotonic()
    try:
        for step, (x, y) in enumerate(data):
            loss = loss_fn(sm(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank])
            if step == 1 and rank == WORLD - 1:
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)                      # "hang": alive, but never joins again
            loss.backward()
            opt.step()
            opt.zero_grad()
        out.put((rank, "finished", 0.0))
    except Exception as e:                          # noqa: BLE001 — the message is the result
        out.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - start))
    out.close()
    out.join_thread()                               # flush the message before leaving
    done.wait(400)                                  # stay up (rank 0 holds the store) until all reported:
    os._exit(0)                                     # a survivor that left would be a dead peer too


def _launch(mode):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "shardc.runtime"])
    out, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_rank, args=(r, port, mode, out, done), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + 400
    while len(got) < WORLD - 1 and time.monotonic() < deadline:
        try:
            rank, msg, secs = out.get(timeout=5)
            got[rank] = (msg, secs)
        except Exception:                           # noqa: BLE001 — queue.Empty: keep waiting
            pass
    done.set()
    for p in procs:
        p.kill()
    return got


@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_survivors_get_a_clear_error(mode):
    got = _launch(mode)
    assert sorted(got) == list(range(WORLD - 1)), got
    for rank, (msg, secs) in got.items():
        assert msg.startswith("PeerFailure: "), msg
        assert "unit '" in msg and any(op in msg for op in ("all_gather", "reduce_scatter", "all_reduce")), msg
        assert secs < 120, (rank, secs)
        if mode == "kill":
            assert f"rank {WORLD - 1} (pid" in msg and "has exited" in msg, msg
        else:
            assert "peer is unknown" in msg, msg
