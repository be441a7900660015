"""Tensor-owned optimizer steps — stage: runtime.

Input: a torch optimizer that is not element-wise (`torch.optim.Muon`) over a
ShardedModule's matrices whose `optim` scope is placed by tensor (dsl/ir.py [Note:
tensor-owned scopes]), or an element-wise one (AdamW) over such a scope's other tensors
(lowering/owned.py [Note: the element-wise remainder is owned too]), and the plan's owners
(`Lowering.owned`, lowering/owned.py, which `ParamSet.owned_plan` holds).
Output: that optimizer's step run on whole tensors, each by its owner only: before the
step every matrix's parameter and reduced gradient go to its owner (one all-to-all per
group, the plan's SYNC row), the optimizer steps whole-tensor stand-ins of the matrices
this rank owns, and after it the updated matrices return to the ranks holding their
chunks (one all-to-all, the UPDATE row), written into the fp32 master chunks that the
update all-gathers then spread as for any optimizer.

[Note: stand-ins]
The optimizer is built over the `ShardParam`s (`p.dim() == 2` as the whole parameter's,
so Muon's own 2-D check passes) and its `param_groups` show them between steps. For the
step only, each group's list holds one persistent stand-in per matrix (an `nn.Parameter`
keyed in the optimizer's state, so its momentum lives whole on the owner, across steps):
on the owner it holds the whole parameter and gradient, elsewhere nothing and no
gradient, which torch's optimizers skip. A parameter whose piece is already whole (optim
`replicate`, or a group of one rank) gets a stand-in too: a view of its piece in its own
shape (a flat piece is 1-D), updated in place, with no communication. After the step the
stand-ins' data are released
and the lists hold the ShardParams again. A whole matrix is transient: the persistent
cost is the owner's optimizer state (K·m·n), as `explain` counts it.
"""
from __future__ import annotations

import weakref
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from ..errors import RuntimeUsageError

STEP = "_shardc_owned_step"             # on an optimizer: its OwnedStep (the optimizer's own state)


def refuse(plan, strategy, backend: str, tp: dict) -> None:
    """What tensor ownership does not run yet, in one sentence each: the whole-step mode,
    an `experts` statement, a tensor-parallel (DTensor) matrix."""
    if not plan.groups:
        return
    where = strategy.file
    if backend == "inductor":
        raise RuntimeUsageError(f"{where}: backend='inductor' does not take an `optim ... by tensor` scope yet; "
                                f"use the eager runtime (backend='eager')")
    if strategy.experts is not None:
        raise RuntimeUsageError(f"{where}: an `optim ... by tensor` scope does not combine with an `experts` "
                                f"statement yet; place the optimizer states element-wise (drop `by tensor`)")
    dt = next((t.name for g in plan.groups for t in g.tensors if t.name in tp), None)
    if dt is not None:
        raise RuntimeUsageError(f"{dt!r} is a tensor-parallel DTensor, which an `optim ... by tensor` scope "
                                f"cannot own whole yet; keep its unit element-wise with an override")


def owned_names(pset) -> dict:
    """name -> (OwnedGroup, OwnedTensor) of every matrix the plan places by tensor."""
    plan = getattr(pset, "owned_plan", None)
    return plan.owner_of() if plan is not None else {}


def adopt(opt, pset, params, views: bool = True) -> bool:
    """`opt` steps whole tensors over the owned ones of `params` (and, with `views`, over
    the whole pieces: an optimizer that is not element-wise); True when it is adopted now
    (its checkpoint hooks are due: runtime/step/owned_state.py)."""
    if step_of(opt) is not None:
        return False
    opt.__dict__[STEP] = OwnedStep(opt, pset, params, views)   # kept by the optimizer: goes with it
    return True


def step_of(opt) -> "OwnedStep | None":
    return opt.__dict__.get(STEP)


def before(opt, consumed: bool = True) -> None:
    step = step_of(opt)
    if step is not None:
        step.to_owners(consumed)


def after(opt) -> None:
    step = step_of(opt)
    if step is not None:
        step.from_owners()


class _Group:
    """One OwnedGroup's matrices that this optimizer holds, with their ShardParams."""

    def __init__(self, group, mine: list, pset):
        self.plan = group
        self.items = list(mine)                                  # plan order
        self.device = mine[0][1].device
        specs = [p._shardc_spec for _, p in self.items]
        self.position = specs[0].index
        if any(s.ranks != group.ranks or s.index != self.position for s in specs):
            raise RuntimeUsageError(f"the owners of {specs[0].name!r} and its group disagree with its chunks")
        comm = pset.comm
        self.pg = comm.smesh.group(group.levels, group.order)
        self.ledger = pset.ledger
        self.rows = group.rows
        if {t.name for t in group.tensors} != {t.name for t, _ in self.items} and group.ranks > 1:
            elems, r = sum(t.numel for t, _ in self.items), group.ranks   # a subset: fewer bytes than the plan's
            self.rows = (replace(group.rows[0], bytes=8 * elems // r), replace(group.rows[1], bytes=4 * elems // r))

    def mine(self) -> list:
        """(OwnedTensor, ShardParam) of the matrices this rank owns, plan order."""
        return [(t, p) for t, p in self.items if t.owner == self.position]


class OwnedStep:
    """One optimizer's whole-tensor step (see the module notes)."""

    def __init__(self, opt, pset, params, views: bool = True):
        self.opt, self.pset = weakref.ref(opt), pset
        names = owned_names(pset)
        by_group: dict[int, tuple] = {}
        held = {p._shardc_spec.name: p for p in params}
        for g in pset.owned_plan.groups:
            mine = [(t, held[t.name]) for t in g.tensors if t.name in held]
            if mine:
                by_group[id(g)] = _Group(g, mine, pset)
        self.groups = list(by_group.values())
        # [Note: stand-ins] whole pieces (optim replicate) are viewed in the parameter's shape, in place
        self.views = {n: p for n, p in held.items() if views and n not in names and p._is_whole}
        self.stand_ins = {n: nn.Parameter(torch.empty(0), requires_grad=True) for n in held
                          if n in names or n in self.views}
        self._saved = None
        self._consumed = True
        self.checkpoint_stash = None             # runtime/step/owned_state.py, between a save's hooks

    # -- before the step ---------------------------------------------------------------------
    def to_owners(self, consumed: bool = True) -> None:
        """Every matrix's parameter and gradient (synced, clipped) to its owner; the
        optimizer's lists hold the stand-ins. A step on gradients that are not shardc's
        (torch's `_init_optim_state`: zero gradients, lr 0) moves nothing: each owner's
        stand-ins get zero values and gradients, which creates their state where it lives."""
        grads = self.pset.grads
        for g in self.groups:
            mine = g.mine()
            wholes = {}
            if consumed:
                sent = {t.name: (p.to_local(), grads[t.name][1]) for t, p in g.items}
                wholes = to_owners(g, sent, g.rows[0])
            else:
                wholes = {t.name: (torch.zeros(t.numel, device=g.device),) * 2 for t, _ in mine}
            for t, p in g.items:
                s = self.stand_ins[t.name]
                if t.name in wholes:
                    w, gr = wholes[t.name]
                    s.data = w.view(t.shape)
                    s.grad = gr.view(t.shape) if consumed else torch.zeros(t.shape, device=g.device)
                else:
                    s.data, s.grad = torch.empty(0), None
        for name, p in self.views.items():
            s, shape = self.stand_ins[name], tuple(p._shardc_spec.global_shape)
            n = p._shardc_spec.numel
            s.data = p.to_local()[:n].view(shape)
            s.grad = (grads[name][1][:n].view(shape) if self.pset.ours(p) else None) if consumed \
                else torch.zeros(shape, device=s.data.device)
        opt = self.opt()
        self._consumed = consumed
        self._saved = [grp["params"] for grp in opt.param_groups]
        for grp in opt.param_groups:
            grp["params"] = [self.stand_ins.get(p._shardc_spec.name, p) for p in grp["params"]]

    # -- after the step ----------------------------------------------------------------------
    def from_owners(self) -> None:
        """The updated matrices back into every rank's master chunks; the optimizer's
        lists hold the ShardParams again."""
        if self._saved is None:
            return
        opt = self.opt()
        for grp, saved in zip(opt.param_groups, self._saved):
            grp["params"] = saved
        self._saved = None
        for g in self.groups:
            if self._consumed:
                back = from_owners(g, {t.name: (self.stand_ins[t.name].detach(),) for t, _ in g.mine()},
                                   {t.name: 1 for t, _ in g.items}, g.rows[1])
                for t, p in g.items:
                    (chunk,) = back[t.name]
                    p.to_local()[:chunk.numel()].copy_(chunk)
            for t, _ in g.items:
                s = self.stand_ins[t.name]
                s.data, s.grad = torch.empty(0), None
        for name in self.views:                  # updated in place: the views share the pieces' storage
            s = self.stand_ins[name]
            s.data, s.grad = torch.empty(0), None


def to_owners(g: _Group, pieces: dict, row) -> dict:
    """Each matrix's pieces (name -> tensors, each this rank's chunk of a tensor of the
    matrix's size, padding after it ignored) to its owner: name -> the whole tensors (flat,
    fp32) of the matrices this rank owns. One all-to-all over the group, recorded as `row`
    (None: not recorded, a checkpoint's)."""
    ranks = g.plan.ranks
    flat, in_split = [], [0] * ranks
    for d in range(ranks):                       # per destination, plan order, the tensors in order
        for t, p in g.items:
            if t.owner == d:
                n = p._shardc_spec.hi - p._shardc_spec.lo
                flat += [x.reshape(-1)[:n] for x in pieces[t.name]]
                in_split[d] += n * len(pieces[t.name])
    k = {t.name: len(pieces[t.name]) for t, _ in g.items}
    inp = torch.cat(flat).float() if flat else torch.empty(0, device=g.device)
    mine = g.mine()
    out_split = [sum(k[t.name] * _len(p._shardc_spec.range_of(c)) for t, p in mine) for c in range(ranks)]
    out = _exchange(g, inp, out_split, in_split, row, torch.float32)
    wholes = {t.name: tuple(out.new_empty(t.numel) for _ in range(k[t.name])) for t, _ in mine}
    at = 0
    for c in range(ranks):
        for t, p in mine:
            a, b = p._shardc_spec.range_of(c)
            for w in wholes[t.name]:
                w[a:b] = out[at:at + b - a]
                at += b - a
    return wholes


def from_owners(g: _Group, wholes: dict, counts: dict, row) -> dict:
    """The reverse: the owner's whole tensors (name -> tensors, of the matrices this rank
    owns) back in chunks, `counts[name]` tensors per matrix: name -> this rank's chunks
    (fp32) of every matrix of the group. One all-to-all, recorded as `row` (None: not)."""
    ranks = g.plan.ranks
    mine = g.mine()
    parts, in_split = [], [0] * ranks
    for c in range(ranks):
        for t, p in mine:
            a, b = p._shardc_spec.range_of(c)
            parts += [w.reshape(-1)[a:b] for w in wholes[t.name]]
            in_split[c] += (b - a) * len(wholes[t.name])
    inp = torch.cat(parts).float() if parts else torch.empty(0, device=g.device)
    out_split = [0] * ranks
    for t, p in g.items:
        out_split[t.owner] += (p._shardc_spec.hi - p._shardc_spec.lo) * counts[t.name]
    out = _exchange(g, inp, out_split, in_split, row, torch.float32)
    back, at = {}, 0
    for d in range(ranks):
        for t, p in g.items:
            if t.owner == d:
                n = p._shardc_spec.hi - p._shardc_spec.lo
                back[t.name] = tuple(out[at + j * n:at + (j + 1) * n] for j in range(counts[t.name]))
                at += n * counts[t.name]
    return back


def _len(r) -> int:
    return r[1] - r[0]


def _exchange(g, inp, out_split, in_split, row, dtype):
    """One owner group's all-to-all (`out_split`/`in_split` elements per rank), recorded
    as its plan row; a group of one rank copies."""
    out = torch.empty(sum(out_split), dtype=dtype, device=inp.device)
    if g.pg is None:
        out.copy_(inp)
    else:
        dist.all_to_all_single(out, inp, out_split, in_split, group=g.pg)
        if row is not None:
            g.ledger.record_row(row)
    return out
