"""The compiled micro-batch — stage: runtime (the whole-step mode, `backend="inductor"`).

Input: the units (their flat storages and plan rows), the model, the functional collectives
(graph/funcol.py), the ledger. Output: `GraphStep`, whose call runs one micro-batch's forward as
one `torch.compile(fullgraph=True)` graph — every unit's parameter gathers and compute,
and, joined by AOTAutograd, its backward: the recomputed gathers and every unit's gradient
reduce-scatter — so `loss.backward()` runs the compiled backward.

[Note: one graph per micro-batch]
The model runs its own forward; each non-root unit's module runs inside a
non-reentrant `checkpoint` region that gathers its flat groups (`gather_function`: the params
rows' all-gather as functional collectives) and swaps the views in for its parameters.
The region's policy saves every activation (as the eager runtime does) and recomputes the
gathers (`MUST_RECOMPUTE`), so AOTAutograd's partitioner re-gathers each unit's parameters
in the backward instead of keeping them: the backward re-gather rows of the plan. The
root unit is gathered once, outside any region, and kept for the backward (it has no
re-gather row). The gather function's backward reduce-scatters the unit's full gradient over G (the
backward rows) and returns it as the gradient of the group's anchor, a leaf shaped like the
grad shard. The step's sync and update are graph/boundary.py's graph.

[Note: gradient hand-off]
The anchors' `.grad` is None when a backward starts, so autograd hands the graph's output
over as it is (it keeps the tensor, with no add and no copy); when the backward is done
(`hand_off`) it goes into the grad shard the way the eager runtime's does (groups/storage.py
[Note: grad accumulation]): copied in when the shard is stale (after zero_grad(), which
only marks it: no zero fill), added otherwise, and the anchor's `.grad` is None again.
A group with no reduce-scatter (s_G = 1, so s_P = 1: the shard is the full buffer) has
one anchor per parameter, and its parameters are the anchors' own views of the shard
(`slots_function`): the backward hands over each parameter's gradient, which
`add_slot_grads` adds into its slice of the shard, and no flat gradient is built.

[Note: deferred update as graphs]
Under the `defer_update` pass opt.step() issues the deferred units' update all-gathers and
returns owing them (graph/update.py [Note: deferred updates, issued at the step]). The
next forward (with or without gradients) is a graph of its own that waits each one with
the opaque op `shardc::await_update` (tagged `UPDATE_TAG`) and writes the result back
into its params shard; the unit's gathers and compute read that result, so
graph/backend.py moves each wait to right before its unit first needs it ([Note: the
update waited where it is needed] there): the eager runtime's rule
(lowering/passes/defer_update.py [Note: deferred update]). What the graph gathers,
recomputes and saves is otherwise the plain graph's. The boundary then owes nothing
(`updates_ran`); a forward that finds only some of them owed completes those first,
eagerly, and runs a graph without updates.
"""
from __future__ import annotations

import functools

import torch
import torch.fx.traceback as fx_traceback
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardc.dsl.errors import ShardcError
from shardc.lowering import Op, Per, Phase

from .backend import GATHER_TAG, UPDATE_TAG, compile_own
from .secondary import RECOMPUTE, SAVE
from . import update as graph_update  # noqa: F401 — registers shardc::await_update

_ATEN = torch.ops.aten
GATHER_OPS = frozenset({torch.ops._c10d_functional.all_gather_into_tensor.default,
                        torch.ops._c10d_functional.wait_tensor.default})
# what a gather's chain is made of besides its collectives (placing chunks, casts): free or
# cheap to redo, so recomputing them where the model's compute uses them too costs nothing
MOVES = frozenset({_ATEN.cat.default, _ATEN.permute.default, _ATEN.clone.default, _ATEN._to_copy.default,
                   _ATEN.split_with_sizes.default, _ATEN.slice.Tensor, _ATEN.view.default,
                   _ATEN._unsafe_view.default, _ATEN.reshape.default, _ATEN.expand.default})


def _policy(ctx, op, *args, **kwargs):
    """[Note: one graph per micro-batch] recompute the gathers (their collectives and the
    data moves that place their chunks), save everything else."""
    if op in SAVE:                      # graph/secondary.py: the hpZ chunk the backward gathers from
        return CheckpointPolicy.MUST_SAVE
    if op in GATHER_OPS or op in MOVES or op in RECOMPUTE or _is_view(op):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


@functools.cache
def _is_view(op) -> bool:
    """An op whose output aliases its input (a view): free to recompute."""
    returns = getattr(getattr(op, "_schema", None), "returns", ())
    return any(r.alias_info is not None and not r.alias_info.is_write for r in returns)


_CONTEXT = functools.partial(create_selective_checkpoint_contexts, _policy)


def gathered(comm, gather_row, shard):
    """A trainable group's full buffer from its params shard (the gather row; none: the
    shard is the full buffer)."""
    return comm.all_gather(gather_row, shard) if gather_row is not None else shard.view(-1)


def gather_function(comm, gather_row, reduce_row):
    """An autograd function for one trainable flat group: forward, its full buffer from its
    params shard (the gather row; none: the shard is the full buffer); backward, the full
    gradient reduce-scattered over G (the reduce row), as the gradient of the grad shard's
    anchor. The rows are closed over, not arguments, so dynamo traces it as a function."""

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, shard, anchor):
            return gathered(comm, gather_row, shard)

        @staticmethod
        def backward(ctx, grad):
            return None, comm.reduce_scatter(reduce_row, grad.contiguous())

    return Gather


class Slots(torch.autograd.Function):
    """A group with no collectives ([Note: gradient hand-off]): forward, the parameters'
    views of the shard; backward, each parameter's gradient to its own anchor."""

    @staticmethod
    def forward(ctx, views, *anchors):
        return tuple(v.view_as(v) for v in views)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


class GraphStep:
    """One micro-batch as one compiled graph (see the module note)."""

    def __init__(self, model, units, comm, names_of, ledger, backend, boundary, on_backward, secondaries,
                 early=None, keys=None):
        self.model, self.units, self.comm, self.names_of, self.ledger = model, units, comm, names_of, ledger
        self.boundary, self.on_backward = boundary, on_backward       # step/boundary.py's StepBoundary
        self.early = early                 # graph/sync.py: the early sync, or None
        self.keys = keys or {}             # graph/update.py: deferred unit -> its owed update's key
        self.anchors, self.gathers, self.secondary = {}, {}, {}
        self._sync = self._update = False  # read while tracing: which of the graphs this is
        self._fresh: dict = {}             # while tracing an updating graph: group -> its new shard
        self._backward_sync = False        # the running backward is the sync graph's
        for u in units:
            for g in u.groups:
                st = g.storage
                if st.secondary is not None:    # graph/secondary.py: a saved tensor of the graph instead
                    bits = st.sec_quant.bits if st.sec_quant else 0
                    self.secondary[id(g)] = (st.q_start, st.q_len, bits, secondaries.add(
                        g.gplan.row(Phase.BACKWARD, Op.ALL_GATHER), st.q_len, bits, st.pdtype))
                    st.secondary = None
                if g.trainable:
                    self._anchor(g)
        for u in units[1:]:
            if len(u.spec.modules) != 1:
                raise ShardcError(f"unit {u.spec.name!r} merges {len(u.spec.modules)} modules (a bucket); "
                                  f"backend='inductor' runs one module per unit: add `bucket 0` to the strategy, "
                                  f"or use the eager runtime (backend='eager')")
            self._wrap(u)
        # the same function, its own graphs (compile_own's copy) for each of: the step's last
        # micro-batch (the early sync) and the forward after opt.step() (the deferred updates)
        self.can_sync = bool(early and early.functions)
        self._graphs = {(sync, update): compile_own(self._micro, backend)
                        for sync in {False, self.can_sync} for update in {False, bool(self.keys)}}
        self.forward_rows = [r for u in units for g in u.groups for r in g.gplan.rows if r.per is Per.FORWARD]
        self.backward_rows = [r for u in units for g in u.groups for r in g.gplan.rows if r.per is Per.BACKWARD]

    def _anchor(self, g) -> None:
        """Group g's anchors (one element each, expanded: only their `.grad` is used) and
        its gather function, or none for a group of slots ([Note: gradient hand-off])."""
        st, gp = g.storage, g.gplan
        gather = gp.row(Phase.FORWARD, Op.ALL_GATHER)
        reduce = gp.row(Phase.BACKWARD, Op.ALL_TO_ALL) or gp.row(Phase.BACKWARD, Op.REDUCE_SCATTER)
        if reduce is None and gather is None and id(g) not in self.secondary:
            shapes = [v.shape for v in st.plain_views(st.shard)]
        else:
            shapes = [st.grad_shard.shape]
            self.gathers[id(g)] = gather_function(self.comm, gather, reduce)
        self.anchors[id(g)] = [torch.nn.Parameter(st.grad_shard.new_zeros(1).expand(s)) for s in shapes]

    def hand_off(self) -> None:
        """A backward is done: the anchors' gradients into the grad shards ([Note: gradient
        hand-off]); after the sync graph's backward, the synced slices too (graph/sync.py)."""
        synced, self._backward_sync = self._backward_sync, False
        due = synced and self.boundary.backward_ends_step()
        for u in self.units:
            g = u.trainable
            if g is None:
                continue
            anchors, st = self.anchors[id(g)], g.storage
            grads = [a.grad for a in anchors]
            if id(g) not in self.gathers:
                st.add_slot_grads(grads)
            elif grads[0] is not None:
                st.accumulate(grads[0])
            for a in anchors:
                a.grad = None
            if synced and self.early.covers(g):
                self.early.hand_off(g, due)

    # -- the traced code -----------------------------------------------------------------
    def _views(self, u) -> dict[str, torch.Tensor]:
        """Unit u's parameters (every name, relative to its module) as views of its gathered groups."""
        out = {}
        prefix = "" if u.index == 0 else u.spec.modules[0] + "."
        for g in u.groups:
            st, gp = g.storage, g.gplan
            gather = gp.row(Phase.FORWARD, Op.ALL_GATHER)
            shard = self._fresh.get(id(g), st.shard)        # updated in this graph, or as stored
            if shard.dtype != st.pdtype:                     # the fp32 master is the shard: cast for the gather
                shard = shard.to(st.pdtype)
            with fx_traceback.annotate({GATHER_TAG: u.index}):       # graph/backend.py's schedule pass
                if g.trainable and id(g) not in self.gathers:      # slots: views of the shard
                    views = Slots.apply(st.plain_views(shard), *self.anchors[id(g)])
                    for s, view in zip(st.layout.slots, views):
                        for name in self.names_of[s.fqn]:
                            out[name[len(prefix):]] = view
                    continue
                if g.trainable and self._sync and self.early.covers(g):     # graph/sync.py
                    full = self.early.functions[id(g)].apply(shard, self.anchors[id(g)][0],
                                                             self.early.anchors[id(g)], st.grad_shard,
                                                             self.early.keeps[id(g)])
                elif g.trainable:
                    full = self.gathers[id(g)].apply(shard, self.anchors[id(g)][0])
                else:
                    full = self.comm.all_gather(gather, st.shard) if gather is not None else st.shard
                if id(g) in self.secondary:
                    start, length, bits, key = self.secondary[id(g)]
                    codes, scales = torch.ops.shardc.keep_secondary(full.detach(), start, length, bits)
                    full = torch.ops.shardc.regather(full, codes, scales, key)
            for s, view in zip(st.layout.slots, st.plain_views(full)):
                for name in self.names_of[s.fqn]:
                    out[name[len(prefix):]] = view
        return out

    def _wrap(self, u) -> None:
        """Unit u's module runs in a checkpoint region that gathers its parameters first."""
        module = self.model.get_submodule(u.spec.modules[0])
        original = module.forward

        def region(*args, **kwargs):
            with _reparametrize_module(module, self._views(u)):
                return original(*args, **kwargs)

        def forward(*args, **kwargs):
            return checkpoint(region, *args, use_reentrant=False, context_fn=_CONTEXT, **kwargs)

        module.forward = forward

    def _micro(self, *args, **kwargs):
        self._fresh = self._updated() if self._update else {}
        try:
            with _reparametrize_module(self.model, self._views(self.units[0])):
                return self.model(*args, **kwargs)
        finally:
            self._fresh = {}

    def _updated(self) -> dict:
        """[Note: deferred update as graphs] each deferred unit's owed update, waited,
        written back into its shard: {group: the new shard}."""
        out = {}
        for u in self.units:
            if u.index in self.keys:
                g = u.trainable
                with fx_traceback.annotate({UPDATE_TAG: u.index}):
                    new = torch.ops.shardc.await_update(g.storage.shard, self.keys[u.index])
                g.storage.shard.copy_(new)
                out[id(g)] = new
        return out

    # -- running it ----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        sync = self.can_sync and torch.is_grad_enabled() and self.boundary.backward_ends_step()
        owed = self.boundary.pending_updates()
        update = bool(owed) and set(owed) == set(self.keys)
        if owed and not update:                # not the set the graph runs: complete them now
            self.boundary.complete_updates()
        self._sync, self._update = sync, update
        try:
            out = self._graphs[sync, update](*args, **kwargs)
        finally:
            self._sync = self._update = False
        if update:
            self.boundary.updates_ran(owed)
        for r in self.forward_rows:
            self.ledger.record_row(r)
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, lambda grads: self._backward_starts(sync), mode="any")
        return out

    def _backward_starts(self, sync: bool = False) -> None:
        """The compiled backward runs every unit's re-gather and reduce-scatter (and, in the
        sync graph, the early sync's rows): record them; when the autograd engine is done,
        the micro-batch counts (`on_backward`)."""
        self.boundary.begin_backward()         # a backward after the step ended folds
        self._backward_sync = sync
        if sync:                               # after the fold: which shards the graph adds to
            self.early.prepare(u.trainable for u in self.units if u.trainable is not None)
        for r in self.backward_rows + (self.early.rows if sync else []):
            self.ledger.record_row(r)
        torch.autograd.Variable._execution_engine.queue_callback(self.on_backward)
