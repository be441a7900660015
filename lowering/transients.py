"""Transient-buffer bounds — stage 3 (lowering): the numbers the runtime's buffers obey and
the cost model's memory timeline reads. Input: none (constants of the plan). Output:
`SYNC_IN_FLIGHT`, `STAGING_BYTES`, `RS_RECV_BYTES`, `RS_RECV_FLOOR` and `recv_block_bytes`,
each the one owner of its fact.

[Note: syncs in flight]
The step-end sync (flat_group.py [Note: reduce and sync]) is issued unit by unit at the
end of the backward that ends the step. At most `SYNC_IN_FLIGHT` flat groups' syncs are
in flight at once: issuing group j's sync first completes (waits, divides) the sync of
group j - SYNC_IN_FLIGHT (runtime/boundary.py). So the sync's transients — a group's
reduce-scatter output chunk (its OS slice, `os_len` elements of the grad dtype) and its
all-reduce's staging (below) — exist for at most SYNC_IN_FLIGHT groups at a time, each
alive from its `sync_issue` to its `sync_wait`. FSDP2 bounds its reduce-scatter states
the same way (at most one in flight past the one being issued). Syncs issued early
during the backward (the `early_sync` plan pass) are outside this bound: the pass
already issues them one unit behind the backward.

[Note: staging chunks]
A hierarchical all-reduce (hierarchical, HO-Ring: a scatter stage before the reduce)
re-lays the tensor out level by level; each of its pieces copies its columns into a
contiguous buffer. These copies go in blocks of at most `STAGING_BYTES` per piece
(runtime/collectives.py `_ar_plan`): a piece's block is copied out, all-reduced through
the stages, copied back, and freed before the piece's next block is copied. With the
block's scatter chunks, the gloo reduce-scatter's receive buffer and the stages' own
buffers, a piece holds at most `STAGING_OVER` blocks (measured on gloo by MemTracker:
4 x the block, tests/test_transients.py), so an all-reduce of n elements holds at most
pieces x STAGING_OVER x min(n bytes, STAGING_BYTES), alive from its issue to its wait,
never the 1.5-2.5 n bytes (a padded copy, the pieces' copies and their stages) it held
before. The padded copy is made only when n is not a multiple
of the inner levels' size (then of n elements, alive for the whole all-reduce).

[Note: receive blocks]
The gloo reduce-scatter stage is an all-to-all and a local sum (runtime/collectives.py
[Note: reduce-scatter on gloo]); its receive buffer is a second copy of the stage's input.
A stage whose output chunk is m elements of e bytes (input s*m) exchanges blocks of columns
whose receive buffer is at most `recv_block_bytes(m * e)` = min(RS_RECV_BYTES,
max(RS_RECV_FLOOR, m * e)) bytes: no more than the output chunk itself (what FSDP2's
reduce-scatter holds beside its input), but at least RS_RECV_FLOOR (so a stage takes at
most s blocks, and never blocks smaller than the floor), and never more than
RS_RECV_BYTES. The buffer is taken from the reduce workspace when the block is issued and
handed back when its local sum is done (runtime/workspace.py [Note: reduce workspace]).
"""
from __future__ import annotations

SYNC_IN_FLIGHT = 2              # [Note: syncs in flight]: flat groups whose step-end sync is in flight
STAGING_BYTES = 32 << 20        # [Note: staging chunks]: one piece's all-reduce staging block, at most
STAGING_OVER = 4                # [Note: staging chunks]: a piece's transients, in blocks, at most
RS_RECV_BYTES = 32 << 20        # [Note: receive blocks]: the all-to-all's receive block, at most
RS_RECV_FLOOR = 1 << 20         # [Note: receive blocks]: ... and at least (when the input is larger)


def recv_block_bytes(chunk_bytes: int, cap: int = RS_RECV_BYTES) -> int:
    """The gloo reduce-scatter's receive block for an output chunk of `chunk_bytes`
    ([Note: receive blocks]); `cap` replaces RS_RECV_BYTES (tests)."""
    return min(cap, max(RS_RECV_FLOOR, chunk_bytes))
