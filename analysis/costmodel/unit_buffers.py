"""The memory timeline's buffers per unit — the bytes each buffer kind holds, for timeline.py.

Input: the lowered plan (`shardc.lowering.Lowering`: each unit's groups, their factors, dtypes
and collective rows), the strategy's mesh and resolved collective algorithm, and whether the
backend reduce-scatters by all-to-all (gloo). Output: `UnitBuffers`, per unit the bytes of
its gathered buffer, autograd's gradient, its reduce's flat input and chunk, the collectives'
staging and codecs (staging.py), its syncs and its update gathers; timeline.py walks the step
over them and says when each is alive.

[Note: timeline: autograd gradient]
In the backward autograd makes the unit's gradients, full size N in the grad dtype, before
the unit's hook lays them out flat (runtime/groups/flat_group.py `reduce_slot_grads`); they are
freed when the unit's views' backward returns (shardc.lowering [Note: reductions in
flight]), after `reduce_grad` has copied them (s_G > 1) or added them in (s_G = 1) and
issued the reduce: so they count beside the reduce's staging and codec at its issue
(measured: zeropp's qgZ issue on HF GPT-2 at 4 ranks, 1.005 with them, 0.945 without).

[Note: timeline: whole gradients]
A group whose one parameter's gradient is its layout already (lowering `GroupPlan.whole_grad`:
one tensor, no padding, grads in the params dtype; runtime/groups/storage.py `whole_grad`:
an embedding's or a head's unit) has no flat input in the workspace: its reduce-scatter
reads autograd's gradient, which the reduce in flight keeps alive until the next unit's
gradients arrive and it is waited (counted there with "reduce-scatter staging"). Counted
in the workspace before, the head's gradient stayed in the pool's high-water mark for the
whole backward: explain 1.085x the measured backward on the 836M model's width at 2 layers.

[Note: timeline: sync chunk]
runtime/groups/flat_group.py `sync_issue`: where the step-end sync has a reduce-scatter stage
(OS∖G), every unit's sync is issued at the end of the backward and each holds its output
chunk (N/s_OS, grad dtype) until `sync_advance` copies it into the OS slice.

[Note: timeline: gather cast]
Where the fp32 master is the params shard (shardc.lowering [Note: the master is the params
shard]), runtime/groups/storage.py `gather_input` casts it to the params dtype for each all-gather
(N/s_P elements, the params dtype): counted with the gathers issued ahead, the cast's
output being the gather's input while it is in flight (a bound: a simulated rank's fake
collectives drop it at once). A backward re-gather from an hpZ secondary casts nothing.

[Note: timeline: collective staging]
A multi-stage collective (hierarchical, ho-ring over two or more levels), a cast to another
comm dtype and a quantized one hold buffers of their own while in flight (staging.py has
the rules, each naming its site in runtime/eager/collectives.py). The backward counts, beside
the reduce in flight, its reduce-scatter's staging; the gather waited for the unit
(`at its wait`: its last two stage buffers) and, at that wait too, the gathers issued
ahead of it (their first stage's buffer; measured: zero3 on HF GPT-2 at 4 ranks, 0.997
with them at the wait, 0.963 without).

"""
from __future__ import annotations

from shardc.lowering import Lowering, Op, Phase, master_is_params

from .staging import all_gather_bytes, all_reduce_bytes, reduce_codec_bytes, reduce_scatter_bytes


def grad_full(u, g) -> int:
    """A group's whole local gradient, grad dtype (its shard times s_G)."""
    return g.grads_bytes * g.factors.g if g.trainable else 0


class UnitBuffers:
    """Per unit: the bytes each buffer kind of the [Note]s holds (staging.py for the collectives')."""

    def __init__(self, plan: Lowering, mesh, algo, a2a: bool = False):
        units = plan.units
        self.gathered = [sum(g.gathered_bytes for g in u.groups) for u in units]
        self.grad = [sum(grad_full(u, g) for g in u.groups) for u in units]
        # the grad shard's bytes ([Note: timeline: grad shards]): from its gradients' arrival
        # (s_G = 1), from its reduce-scatter's issue (s_G > 1)
        self.shard_on_arrival = [sum(g.grads_bytes for g in u.groups if g.trainable and g.factors.g == 1)
                                 for u in units]
        self.shard_on_wait = [sum(g.grads_bytes for g in u.groups if g.trainable and g.factors.g > 1)
                              for u in units]
        self.reduce, self.rs_staging, self.rs_codec, self.sync, self.sync_ar = ([] for _ in range(5))
        # the gloo all-to-all's receive blocks (staging.py [Note: staging: receive blocks]; none on
        # a native reduce-scatter): a backward reduce's come from the reduce workspace, which
        # keeps them ([Note: timeline: reduce workspace]), per unit; the syncs' in their staging
        self.recv: list[int] = []
        self.has_ar: list[bool] = []
        self.update: list[tuple[int, int, int]] = []  # per group with an update gather: (unit, issued, more at its wait)
        # per phase (forward, backward): a gather issued ahead, and at its wait (codec included)
        self.ag_issued = {Phase.FORWARD: [], Phase.BACKWARD: []}
        self.ag_wait = {Phase.FORWARD: [], Phase.BACKWARD: []}
        self.kept_grad: list[int] = []       # a whole gradient held by its reduce-scatter in flight
        for u in units:
            red = rs = rc = syn = ar = recv = kept = 0
            has_ar = False
            ag = {ph: [0, 0] for ph in self.ag_wait}
            for g in u.groups:
                f = g.factors
                cast = (g.gathered_bytes // f.p
                        if master_is_params(u.scopes.params.dtype, g.trainable, f.p, f.os) else 0)
                if g.gathered_bytes and mesh is not None:
                    for ph in ag:
                        row = g.row(ph, Op.ALL_GATHER) or g.row(Phase.FORWARD, Op.ALL_GATHER)
                        a, b = all_gather_bytes(mesh, algo, row, g.n, g.gathered_bytes // max(g.n, 1))
                        # the master cast for the gather ([Note: timeline: gather cast])
                        ag[ph][0] += a + (cast if ph is Phase.FORWARD or not g.secondary_bytes else 0)
                        ag[ph][1] += b
                if not g.trainable:
                    continue
                e = grad_full(u, g) // max(g.n, 1)
                if f.g > 1:
                    # the flat input (none where the gradient is reduced as autograd made it:
                    # that one stays alive in flight instead, [Note: timeline: whole gradients])
                    red += (0 if g.whole_grad else grad_full(u, g)) + g.grads_bytes
                    kept += grad_full(u, g) if g.whole_grad else 0
                    if mesh is not None:
                        row = g.row(Phase.BACKWARD, Op.ALL_TO_ALL) or g.row(Phase.BACKWARD, Op.REDUCE_SCATTER)
                        rs += reduce_scatter_bytes(mesh, algo, row, g.n, e)
                        recv += reduce_scatter_bytes(mesh, algo, row, g.n, e, a2a) - reduce_scatter_bytes(
                            mesh, algo, row, g.n, e)
                        rc = max(rc, reduce_codec_bytes(mesh, row, g.n, e))
                up = g.row(Phase.UPDATE, Op.ALL_GATHER)
                if up is not None and mesh is not None:
                    pe = g.params_bytes * f.p // max(g.n, 1)
                    a, b = all_gather_bytes(mesh, algo, up, g.n // max(f.p, 1), pe)
                    self.update.append((len(self.reduce), g.optim_elems * pe + a, b - a))
                rs_row, ar_row = g.row(Phase.SYNC, Op.REDUCE_SCATTER), g.row(Phase.SYNC, Op.ALL_REDUCE)
                if rs_row is not None:
                    syn += g.optim_elems * e + (reduce_scatter_bytes(mesh, algo, rs_row, g.n // f.g, e, a2a)
                                                if mesh is not None else 0)
                if ar_row is not None:
                    has_ar = True
                if ar_row is not None and mesh is not None:
                    ar += all_reduce_bytes(mesh, algo, ar_row, g.optim_elems, e, a2a)
            for lst, v in ((self.reduce, red), (self.rs_staging, rs), (self.rs_codec, rc), (self.sync, syn),
                           (self.sync_ar, ar), (self.recv, recv), (self.kept_grad, kept)):
                lst.append(v)
            self.has_ar.append(has_ar)
            for ph, (a, b) in ag.items():
                self.ag_issued[ph].append(a)
                self.ag_wait[ph].append(b)

    def synced_early(self, i: int, advanced: bool) -> int:
        """Unit i's early sync: in its reduce-scatter stage (its chunk and staging), or advanced
        to its all-reduce (its chunk copied into the OS slice and freed: the all-reduce's
        staging only); a sync with no all-reduce stays in its reduce-scatter stage, one with
        no reduce-scatter is in its all-reduce from its issue."""
        if advanced and self.has_ar[i]:
            return self.sync_ar[i]
        return self.sync[i] if self.sync[i] else self.sync_ar[i]
