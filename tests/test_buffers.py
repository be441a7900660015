"""Buffers as DDP keeps them: a BatchNorm model on 4 gloo ranks (each rank normalises its
own batch, as under DDP without SyncBatchNorm) against torch's DistributedDataParallel on
the same rank-local batches. `buffers broadcast` (the default): running statistics equal
on every rank and equal to DDP's rank 0 (whose buffers DDP broadcasts before each forward);
`buffers local`: each rank's statistics equal DDP's with broadcast_buffers=False on that
rank. Parameters match DDP in both cases."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from tests.harness import dist_run
from tests.test_runtime_util import max_rel_err, strategy

pytestmark = pytest.mark.distributed
STEPS = 3


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, 9)
        self.body = nn.Sequential(nn.BatchNorm1d(9), nn.Tanh(), nn.Linear(9, 9), nn.BatchNorm1d(9))
        self.out = nn.Linear(9, 3)

    def forward(self, x):
        return self.out(self.body(self.inp(x)))


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)       # every rank its own batches
    return [(torch.randn(6, 5, generator=g) * (1 + rank), torch.randn(6, 3, generator=g))
            for _ in range(STEPS)]


def _train(model, opt, data):
    for x, y in data:
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def _run(rank, world, mode):
    from shardc.dsl.ir import BufferSync
    from shardc.runtime import UnitSpec, shard_module
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = BNNet()
    s = dataclasses.replace(strategy("zero3", "node(2) > gpu(2)", accumulate=1),
                            buffers=BufferSync(mode))
    body = tuple(n for n, _ in model.named_parameters() if n.startswith("body."))
    units = [UnitSpec("<root>", tuple(n for n, _ in model.named_parameters() if n not in body), s.scopes),
             UnitSpec("body", body, s.scopes, ("body",))]
    sm = shard_module(copy.deepcopy(model), s, units)
    _train(sm, sm.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9), _data(rank))
    ddp = DDP(copy.deepcopy(model), broadcast_buffers=(mode == "broadcast"))
    _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), _data(rank))
    want = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    return sm.full_state_dict(), want


@pytest.mark.parametrize("mode", ["broadcast", "local"])
def test_batchnorm_buffers_follow_ddp(mode):
    res = dist_run(4, _run, mode)
    stats = [k for k in res[0][1] if "running" in k]
    assert len(stats) == 4
    for rank, (got, want) in enumerate(res):
        params = {k: v for k, v in want.items() if "running" not in k and "num_batches" not in k}
        assert max_rel_err(got, params) < 1e-5
        ref = res[0][1] if mode == "broadcast" else want
        for k in stats:
            assert torch.allclose(got[k], ref[k], rtol=1e-6, atol=1e-7), (rank, k)
            assert int(got[k.replace("running_mean", "num_batches_tracked").replace("running_var", "num_batches_tracked")]) == STEPS
        if mode == "broadcast":
            for k in stats:
                assert torch.equal(got[k], res[0][0][k]), (rank, k)
    if mode == "local":                                   # the ranks really differ
        assert not torch.allclose(res[0][0][stats[0]], res[1][0][stats[0]])


def test_buffers_statement_resolves():
    import shardc
    from shardc.dsl.ir import BufferSync
    base = "mesh gpu(4)\nparams shard over gpu\ngrads shard over gpu\noptim shard over gpu\n"
    assert shardc.load_strategy(base).buffers is BufferSync.BROADCAST
    assert shardc.load_strategy(base + "buffers local\n").buffers is BufferSync.LOCAL
    assert shardc.load_strategy(base + "buffers broadcast\n").buffers is BufferSync.BROADCAST
