"""Overlap: `prefetch` changes when gathers are issued, never the numbers.

prefetch 0 and prefetch 2 train to bitwise-identical losses and parameters; with
prefetch >= 1 the runtime's event log (ShardedModule.events, not timing) shows unit
i+1's gather issued before unit i runs, and with prefetch 0 only after it ran. The
strategy says `bucket 0`: the units stay one per block for every prefetch.
"""
import pytest
import torch
import torch.nn.functional as F

import shardc
from examples.gpt import GPT, GPTConfig
from tests.harness import dist_run

pytestmark = pytest.mark.distributed
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
TEXT = """mesh node(2) > gpu(2)
params shard over world
grads  shard over world
optim  shard over world
accumulate 2
prefetch {p}
bucket 0
"""


def _job(rank, world, prefetches):
    out = {}
    for p in prefetches:
        torch.manual_seed(0)
        sm = shardc.compile(GPT(CFG), TEXT.format(p=p), capture="fx")
        opt = sm.optimizer(torch.optim.AdamW, lr=1e-3)
        g = torch.Generator().manual_seed(5)
        losses = []
        for _ in range(2):
            for _ in range(2):
                x = torch.randint(0, CFG.vocab_size, (world * 2, CFG.block_size), generator=g).chunk(world)[rank]
                loss = F.cross_entropy(sm(x).flatten(0, 1), x.flatten()) / 2
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        events = list(sm.events)
        with torch.no_grad():
            sm(x)
        out[p] = (losses, sm.full_state_dict(), events)
    return out


def _first(events, ev):
    return events.index(ev)


def test_prefetch_changes_schedule_not_numerics():
    results = dist_run(4, _job, (0, 1, 2))
    for r in results:
        assert r[0][0] == r[2][0] and r[0][0] == r[1][0]                 # bitwise-equal losses
        for name, t in r[0][1].items():
            assert torch.equal(t, r[2][1][name]), name
        for p in (1, 2):          # unit i+1's gather issued before unit i runs (first forward)
            ev = r[p][2]
            for i in (1, 2):
                assert _first(ev, ("issue_gather", i + 1)) < _first(ev, ("run", i)), (p, i, ev[:12])
        ev = r[2][2]              # prefetch 2: unit 3 issued before unit 1 runs
        assert _first(ev, ("issue_gather", 3)) < _first(ev, ("run", 1))
        ev = r[0][2]              # prefetch 0: issued only once the previous unit has run
        for i in (1, 2):
            assert _first(ev, ("issue_gather", i + 1)) > _first(ev, ("run", i)), (i, ev[:12])
