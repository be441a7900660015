"""Runtime bounds the memory timeline reads — stage 3 (lowering): constants of the plan that
runtime/ obeys and analysis/costmodel/timeline.py counts. Input: none. Output:
`CODEC_ROWS`, the one owner of its fact. The transient buffers' bounds (REDUCE_IN_FLIGHT,
RELEASE_GRADS, SYNC_IN_FLIGHT, STAGING_BYTES, ...) live in lowering/transients.py.
"""
from __future__ import annotations

CODEC_ROWS = 1 << 24            # [Note: codec batches]: elements a quantized collective codes per call, at most

# [Note: codec batches]
# A quantized collective (qwZ's gather, hpZ's secondary gather in int8, qgZ's reduce-scatter)
# encodes or decodes its s chunks as rows of one tensor, in batches of at most CODEC_ROWS
# elements (and at least one row), so the codec's float temporaries are bounded by a batch,
# never by the whole collective. runtime/quant.py `ROWS_AT_ONCE` is this bound
# (tests/test_peak_phases.py holds the two equal until the runtime reads it from here).
