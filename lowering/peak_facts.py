"""Runtime bounds the memory timeline reads — stage 3 (lowering): constants of the plan that
runtime/ obeys and analysis/costmodel/timeline.py counts. Input: none. Output:
`REDUCES_IN_FLIGHT`, the one owner of its fact (the others live in lowering/transients.py).

[Note: reduces in flight]
In the backward each unit's gradient is reduce-scattered as soon as autograd made it
(runtime/flat_group.py `reduce_grad`); issuing unit j's reduce-scatter first waits unit
j-1's (runtime/engine.py `_bound_reductions`, FSDP2's rule), so at most REDUCES_IN_FLIGHT
units' reductions — each its flat input, its output chunk and its collective's staging —
are alive at once: the one just issued and the one before it.
"""
from __future__ import annotations

REDUCES_IN_FLIGHT = 2           # [Note: reduces in flight]: units whose backward reduce is in flight
CODEC_ROWS = 1 << 24            # [Note: codec batches]: elements a quantized collective codes per call, at most

# [Note: codec batches]
# A quantized collective (qwZ's gather, hpZ's secondary gather in int8, qgZ's reduce-scatter)
# encodes or decodes its s chunks as rows of one tensor, in batches of at most CODEC_ROWS
# elements (and at least one row), so the codec's float temporaries are bounded by a batch,
# never by the whole collective. runtime/quant.py `ROWS_AT_ONCE` is this bound
# (tests/test_peak_phases.py holds the two equal until the runtime reads it from here).
