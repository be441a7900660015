"""Expert groups in the runtime: a unit's experts are a flat group of their own with the
`experts` block's scopes, beside the unit's dense parameters (issue: expert parallelism,
the seam it builds on). Real `.shard` text through the unit finder, the lowering and the
eager runtime on 4 gloo ranks: training equals one process on the concatenated batch
(SGD with momentum and AdamW, 2 micro-batches, clip_grad_norm_), and the measured ledger
and memory equal `explain`'s, the experts' records apart.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from shardc.lowering import Over
from tests.harness import dist_run

pytestmark = pytest.mark.distributed
E, H, F, T = 4, 8, 12, 6
MESH = "node(2) > gpu(2)"
ZERO3_EXPERTS_ZERO1 = """mesh node(2) > gpu(2)
params shard over world
grads  shard over world
optim  shard over world
accumulate 2
experts "*.experts" {
    params replicate
    grads  replicate
    optim  shard over world
}
"""
IIG_EXPERTS_OVER_NODE = """mesh node(2) > gpu(2)
params shard over gpu
grads  shard over gpu
optim  shard over world
accumulate 2
experts "*.experts" {
    params replicate
    grads  shard over node
    optim  shard over node
}
"""
CASES = [(ZERO3_EXPERTS_ZERO1, "sgd"), (IIG_EXPERTS_OVER_NODE, "adamw")]


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, F, H) / H ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, F) / F ** 0.5)

    def forward(self, x, gates):
        h = torch.einsum("td,efd->tef", x, self.w1).relu()
        return (gates.unsqueeze(-1) * torch.einsum("tef,edf->ted", h, self.w2)).sum(1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(H, H)
        self.router = nn.Linear(H, E)
        self.experts = Experts()

    def forward(self, x):
        x = x + self.attn(x).tanh()
        flat = x.flatten(0, 1)
        return x + self.experts(flat, self.router(flat).softmax(-1)).view_as(x)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(H, H)

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return MoE()


def batches(rank, steps=2, micro=2):
    g = torch.Generator().manual_seed(100 + rank)
    return [[torch.randn(2, T, H, generator=g) for _ in range(micro)] for _ in range(steps)]


def train(m, opt, steps, clip):
    for micro in steps:
        for x in micro:
            (m(x).pow(2).mean() / len(micro)).backward()
        clip(1.0)
        opt.step()
        opt.zero_grad()


def _job(rank, world):
    import shardc
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.runtime import shard_module
    from shardc.units import find_units
    out = []
    for text, kind in CASES:
        s = shardc.load_strategy(text)
        m = model()
        sm = shard_module(m, s, find_units(m, resolve_bucket(m, s)))
        cls, kw = _opt(kind)
        train(sm, sm.optimizer(cls, **kw), batches(rank), sm.clip_grad_norm_)
        out.append((sm.full_state_dict(), list(sm.comm_ledger()), dict(sm.memory_report())))
    return out


def _opt(kind):
    return (torch.optim.SGD, dict(lr=0.1, momentum=0.9)) if kind == "sgd" else \
        (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))


def reference(kind, world):
    """One process on the concatenated batch: each micro-batch is every rank's, the loss
    their mean (equal sizes)."""
    m = model()
    per_rank = [batches(r) for r in range(world)]
    steps = [[torch.cat([per_rank[r][s][k] for r in range(world)]) for k in range(2)] for s in range(2)]
    cls, kw = _opt(kind)
    train(m, cls(m.parameters(), **kw), steps, lambda n: torch.nn.utils.clip_grad_norm_(m.parameters(), n))
    return {k: v.detach() for k, v in m.state_dict().items()}


def test_expert_groups_train_at_parity_and_the_ledger_is_explains():
    import shardc
    from shardc.analysis.costmodel import predict_ledger, predict_memory
    from shardc.analysis.costmodel.report import model_units
    results = dist_run(4, _job)
    for c, (text, kind) in enumerate(CASES):
        want = reference(kind, 4)
        for rank in results:
            sd = rank[c][0]
            for k, v in want.items():
                assert float((sd[k] - v).norm() / v.norm()) < 1e-5, (kind, k)
        s = shardc.load_strategy(text)
        units = model_units(s, model())
        assert any(u.counts(Over.EXPERTS)[0] for u in units) and all(u.trainable for u in units[1:])
        ledger, memory = results[0][c][1], results[0][c][2]
        predicted = [dataclasses.replace(r, count=2 * r.count)          # two steps
                     for r in predict_ledger(s, units, micro_batches=2, clip_grad_norm=True)]
        assert ledger == predicted and any(r.over == "experts" for r in ledger), \
            ([r for r in ledger if r not in predicted], [r for r in predicted if r not in ledger])
        p_mem = predict_memory(s.mesh, units, optimizer="adamw" if kind == "adamw" else "sgd",
                               optimizer_kwargs={} if kind == "adamw" else {"momentum": 0.9})
        assert {k: p_mem[k] for k in ("params", "grads", "optim", "total")} == \
            {k: memory[k] for k in ("params", "grads", "optim", "total")}


def _update_job(rank, world):
    """Every deferred update all-gather of a unit with two groups that have one is waited
    before the unit runs again (each group's, not only the last one's)."""
    import shardc
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.runtime import shard_module
    from shardc.runtime.groups.flat_group import FlatGroup
    from shardc.units import find_units
    issued, original = [], FlatGroup.update_issue

    def tracked(self, record=True):
        work, entry = original(self, record), [self.gplan.placement.over == Over.EXPERTS, False]
        issued.append(entry)

        class Waited:
            def wait(self_):
                entry[1] = True
                return work.wait()
        return Waited()

    FlatGroup.update_issue = tracked
    try:
        s = shardc.load_strategy(IIG_EXPERTS_OVER_NODE)
        m = model()
        sm = shard_module(m, s, find_units(m, resolve_bucket(m, s)))
        deferred = sm.lowering.schedule.update_deferred
        opt = sm.optimizer(torch.optim.SGD, lr=0.1)
        train(sm, opt, batches(rank, steps=1), sm.clip_grad_norm_)
        sm(batches(rank)[0][0])                        # the next forward needs every unit's update
        return deferred, issued
    finally:
        FlatGroup.update_issue = original


def test_a_units_two_update_gathers_are_both_waited():
    deferred, issued = dist_run(4, _update_job)[0]
    assert deferred and {e for e, _ in issued} == {False, True}
    assert all(waited for _, waited in issued), issued


# -- load-balancing state ------------------------------------------------------------------------
class Balanced(Block):
    """A block with DeepSeek-V3's aux-loss-free balancing: a per-expert bias on the router's
    logits, counts of each expert's top-1 tokens, updated at the step from the counts summed
    over the data-parallel ranks (torchtitan's optimizer step pre-hook)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.zeros(E))
        self.register_buffer("counts", torch.zeros(E))

    def forward(self, x):
        x = x + self.attn(x).tanh()
        flat = x.flatten(0, 1)
        logits = self.router(flat) + self.bias
        with torch.no_grad():
            self.counts += torch.bincount(logits.argmax(-1), minlength=E).float()
        return x + self.experts(flat, logits.softmax(-1)).view_as(x)


def balanced():
    torch.manual_seed(0)
    m = MoE()
    m.layers = nn.ModuleList(Balanced() for _ in range(2))
    torch.manual_seed(1)
    for p in m.parameters():
        p.data.copy_(torch.randn_like(p) * 0.3)
    return m


def rebalance(blocks, ranks=False):
    """The step pre-hook: counts summed over the data-parallel ranks (here the world),
    bias moved toward the mean."""
    import torch.distributed as dist
    for b in blocks:
        if ranks:
            dist.all_reduce(b.counts)
        b.bias += 0.05 * torch.sign(b.counts.mean() - b.counts)
        b.counts.zero_()


def _balanced_job(rank, world, buffers):
    import shardc
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.runtime import shard_module
    from shardc.units import find_units
    s = shardc.load_strategy(ZERO3_EXPERTS_ZERO1 + buffers)
    m = balanced()
    sm = shard_module(m, s, find_units(m, resolve_bucket(m, s)))
    opt = sm.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    opt.register_step_pre_hook(lambda *_: rebalance(list(m.layers), ranks=True))
    train(sm, opt, batches(rank, steps=2), sm.clip_grad_norm_)
    return [b.bias.clone() for b in m.layers], sm.full_state_dict()


def test_load_balancing_counts_are_summed_over_the_ranks_as_one_process_would():
    m = balanced()
    per = [batches(r, steps=2) for r in range(4)]
    steps = [[torch.cat([per[r][s][k] for r in range(4)]) for k in range(2)] for s in range(2)]
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    opt.register_step_pre_hook(lambda *_: rebalance(list(m.layers)))
    train(m, opt, steps, lambda n: torch.nn.utils.clip_grad_norm_(m.parameters(), n))
    want = [b.bias for b in m.layers]
    assert any(float(w.abs().sum()) > 0 for w in want)
    for bias, sd in dist_run(4, _balanced_job, ""):            # an experts strategy keeps each rank's
        for got, w in zip(bias, want):
            torch.testing.assert_close(got, w)
        for k, v in m.state_dict().items():
            assert float((sd[k] - v).norm() / v.norm().clamp_min(1e-12)) < 1e-5, k
    broadcast = dist_run(4, _balanced_job, "buffers broadcast\n")    # rank 0's counts each forward
    assert any(not torch.equal(got, w) for got, w in zip(broadcast[0][0], want))
