"""The distributed test harness: results by rank, failures with tracebacks, timeouts."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import dist_run

pytestmark = pytest.mark.distributed


def _sum_ranks(rank, world, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world, scale * t.item(), dist.get_rank(), dist.get_world_size()


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def _hang_on_zero(rank, world):
    if rank == 0:
        time.sleep(60)
    return rank


def test_results_come_back_by_rank():
    out = dist_run(4, _sum_ranks, 2.0)
    assert out == [(r, 4, 2.0 * (0 + 1 + 2 + 3), r, 4) for r in range(4)]
    # the pool is reused: a second job works on the same process group
    assert dist_run(4, _sum_ranks, 1.0)[3] == (3, 4, 6.0, 3, 4)


def test_failing_rank_gives_its_traceback():
    with pytest.raises(AssertionError) as info:
        dist_run(2, _fail_on_one)
    msg = str(info.value)
    assert "rank 1/2 failed" in msg and "ValueError: boom on rank one" in msg
    assert "_fail_on_one" in msg
    # a fresh pool is built afterwards
    assert dist_run(2, _sum_ranks, 1.0) == [(0, 2, 1.0, 0, 2), (1, 2, 1.0, 1, 2)]


def test_timeout_does_not_hang():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="timed out"):
        dist_run(2, _hang_on_zero, timeout=3)
    assert time.monotonic() - t0 < 120            # 3 s, plus a generous margin for a busy machine
    assert dist_run(2, _sum_ranks, 3.0)[0] == (0, 2, 3.0, 0, 2)
