"""Transient-buffer bounds — stage 3 (lowering): the numbers the runtime's buffers obey and
the cost model's memory timeline reads. Input: none (constants of the plan). Output:
`REDUCE_IN_FLIGHT`, `RELEASE_GRADS`, `SYNC_IN_FLIGHT`, `STAGING_BYTES`, `RS_RECV_BYTES`, `RS_RECV_FLOOR` and
`recv_block_bytes`, each the one owner of its fact.

[Note: reductions in flight]
In a backward, a unit's gradients arrive (autograd's, one tensor per parameter) when its
views' backward runs (runtime/groups/storage.py). Before they are laid out flat, the reduce-
scatters of the units before it are waited until fewer than `REDUCE_IN_FLIGHT` remain
(runtime/eager/engine.py), and the unit's gathered full buffer is released (N of the params
dtype, from its backward re-gather to here; FSDP2 reshards before its copy-in too): with 1, the previous unit's reduce-scatter completes, its flat input
(N_prev elements of the grad dtype) and output chunk (N_prev/s_G) go back to the reduce
workspace, and this unit's flat input reuses them. So a unit's backward holds, beside
what it computes: autograd's gradients (N, alive until its views' backward returns, right
after the copy into the flat input: FSDP2's copy-in), the flat input (N, from the copy
to the wait at the next unit's gradients), the output chunk (N/s_G, the same span) and
the previous unit's nothing. The workspace keeps what was handed back for reuse until the
step's backwards are over, so it holds max over units of (N + N/s_G) plus one receive block.
A one-parameter unit reduce-scatters autograd's gradient itself (no flat copy): it is
then alive to the same wait. FSDP2 does the same: `foreach_reduce` waits the previous
reduce-scatter's state before the next copy-in.

[Note: gradient lifetimes]
With `RELEASE_GRADS`, the eager runtime's zero_grad() frees every trainable group's grad
shard (N/s_G elements of the grads dtype; its storage resized to 0, runtime/groups/storage.py
[Note: grad shard lifetime]) and the fp32 copies a bf16 grad shard is read through
(N/s_OS x 4 bytes, runtime/state/params.py [Note: gradients]), as torch's
zero_grad(set_to_none=True) frees a model's gradients. So a grad shard exists from its
unit's first reduced gradient of the step (s_G > 1: its backward reduce-scatter waited,
as the next unit's gradients arrive or at the backward's end; s_G = 1: its gradients'
arrival; a unit that got none: the sync) until zero_grad(); the fp32 copies from the
step's sync completing (opt.step(), clip_grad_norm_, a gradient read) until zero_grad().
The forward after zero_grad() holds neither. The whole-step mode keeps its grad shards
(its graphs read them). `memory_report()`'s `grads` is the shard's size either way.

[Note: syncs in flight]
The step-end sync (runtime/groups/flat_group.py [Note: reduce and sync]) is issued unit by unit at the
end of the backward that ends the step. At most `SYNC_IN_FLIGHT` flat groups' syncs are
in flight at once: issuing group j's sync first completes (waits, divides) the sync of
group j - SYNC_IN_FLIGHT (runtime/step/boundary.py). So the sync's transients — a group's
reduce-scatter output chunk (its OS slice, `os_len` elements of the grad dtype) and its
all-reduce's staging (below) — exist for at most SYNC_IN_FLIGHT groups at a time, each
alive from its `sync_issue` to its `sync_wait`. FSDP2 bounds its reduce-scatter states
the same way (at most one in flight past the one being issued). Syncs issued early
during the backward (the `early_sync` plan pass) are outside this bound: the pass
already issues them one unit behind the backward.

[Note: staging chunks]
A hierarchical all-gather, reduce-scatter or all-reduce over two or more levels
(hierarchical, HO-Ring: one stage per level) re-lays the tensor out level by level; each
of its pieces copies its columns into a contiguous buffer in the stages' order (an
all-gather: gathers them stage by stage into buffers of its own, then places them). These copies go in
blocks of at most `STAGING_BYTES` for all of the collective's pieces together, STAGING_BYTES /
pieces each (`staging_block`, read by runtime/eager/collectives.py `_ar_plan`, `_rs_pieces`,
`_ag_bytes` and by explain's staging rules; HO-Ring runs 4 pieces at once from the issue, so
a per-piece bound held 4 blocks of a collective in flight, 0.13 GB of LLaMA-65B's layer
reduce-scatter at 1024 ranks, where FSDP2's flat one holds none): a piece's block is copied out, reduced through the stages (an all-reduce's
is copied back; a reduce-scatter's last stage writes its columns of the output; an
all-gather's last stage's buffer is placed into its columns of the output), and freed
before the piece's next block is copied. A one-stage reduce-scatter (one level, or
the ring over several) reads its input in place: no staging. With the
block's scatter chunks, the gloo reduce-scatter's receive buffer and the stages' own
buffers, a piece holds at most `STAGING_OVER` blocks (measured on gloo by MemTracker
over two levels: 2.5 x the block for a reduce-scatter or an all-reduce, 1.5 for an
all-gather, tests/test_transients.py; more levels add their smaller chunks; the blocks
reuse their buffers, runtime/eager/collectives.py [Note: blocks reuse their buffers]), so an all-reduce of n elements holds at most
STAGING_OVER x min(n bytes, STAGING_BYTES) over its pieces, alive from its issue to its wait,
never the 1.5-2.5 n bytes (a padded copy, the pieces' copies and their stages) it held
before; a staged reduce-scatter of an n-element input, or all-gather of an n-element
output, likewise (before: n for the pieces' copies, plus their stages' buffers). The padded copy is made only when n is not a multiple
of the inner levels' size (then of n elements, alive for the whole all-reduce).

[Note: receive blocks]
The gloo reduce-scatter stage is an all-to-all and a local sum (runtime/eager/collectives.py
[Note: reduce-scatter on gloo]); its receive buffer is a second copy of the stage's input.
A stage whose output chunk is m elements of e bytes (input s*m) exchanges blocks of columns
whose receive buffer is at most `recv_block_bytes(m * e)` = min(RS_RECV_BYTES,
max(RS_RECV_FLOOR, m * e)) bytes: no more than the output chunk itself (what FSDP2's
reduce-scatter holds beside its input), but at least RS_RECV_FLOOR (so a stage takes at
most s blocks, and never blocks smaller than the floor), and never more than
RS_RECV_BYTES. The buffer is taken from the reduce workspace when the block is issued and
handed back when its local sum is done (runtime/groups/workspace.py [Note: reduce workspace]).
A stage whose columns take more than one block frees each block before it takes the next
(one block alive at a time). `A2A_RS_BACKENDS` names the backends that reduce-scatter this
way (the runtime's choice per process group, runtime/transport/device.py; explain's
`--backend`, whose timeline counts the blocks: analysis/costmodel/staging.py); a device
backend's native reduce-scatter (NCCL) and a simulated rank's fake one hold none.
"""
from __future__ import annotations

REDUCE_IN_FLIGHT = 1            # [Note: reductions in flight]: backward reduce-scatters in flight as a unit's grads arrive
RELEASE_GRADS = True            # [Note: gradient lifetimes]: zero_grad() frees the grad shards and fp32 grad copies
SYNC_IN_FLIGHT = 2              # [Note: syncs in flight]: flat groups whose step-end sync is in flight
STAGING_BYTES = 32 << 20        # [Note: staging chunks]: a staged collective's blocks, all its pieces together, at most
STAGING_OVER = 4                # [Note: staging chunks]: a piece's transients, in blocks, at most
RS_RECV_BYTES = 32 << 20        # [Note: receive blocks]: the all-to-all's receive block, at most
RS_RECV_FLOOR = 1 << 20         # [Note: receive blocks]: ... and at least (when the input is larger)
A2A_RS_BACKENDS = frozenset({"gloo"})   # [Note: receive blocks]: reduce-scatter as an all-to-all and a sum


def recv_block_bytes(chunk_bytes: int, cap: int = RS_RECV_BYTES) -> int:
    """The gloo reduce-scatter's receive block for an output chunk of `chunk_bytes`
    ([Note: receive blocks]); `cap` replaces RS_RECV_BYTES (tests)."""
    return min(cap, max(RS_RECV_FLOOR, chunk_bytes))


def staging_block(column_bytes: int, pieces: int, cap: int = STAGING_BYTES) -> int:
    """Columns in one piece's staging block ([Note: staging chunks]): the blocks of a
    collective's `pieces` together at most `cap` bytes (STAGING_BYTES; the runtime passes its
    own module's, which a test may lower), a column being `column_bytes`; at least one."""
    return max(1, cap // (max(pieces, 1) * column_bytes))


def recv_bytes(m: int, s: int, e: int, cap: int = RS_RECV_BYTES) -> int:
    """The receive buffer one all-to-all reduce-scatter stage holds at a time: s ranks, an
    output chunk of m elements of e bytes ([Note: receive blocks]; runtime/eager/collectives.py
    `_rs`): one block of columns, or the whole input when one block covers it."""
    if s < 2 or m < 1:
        return 0
    cols = max(1, recv_block_bytes(m * e, cap) // (s * e))
    return s * min(cols, m) * e
