"""Runtime bounds the memory timeline reads — stage 3 (lowering): constants of the plan that
runtime/ obeys and analysis/costmodel/timeline.py counts. Input: none. Output:
`CODEC_ROWS`, the one owner of its fact. The transient buffers' bounds (REDUCE_IN_FLIGHT,
RELEASE_GRADS, SYNC_IN_FLIGHT, STAGING_BYTES, ...) live in lowering/transients.py.
"""
from __future__ import annotations

CODEC_ROWS = 1 << 20            # [Note: codec batches]: elements a quantized collective codes per call, at most

# [Note: codec batches]
# A quantized collective (qwZ's gather, hpZ's secondary gather in int8, qgZ's reduce-scatter)
# encodes or decodes its s chunks as rows of one tensor, in batches of at most CODEC_ROWS
# elements (and at least one row), so the codec's float temporaries are bounded by a batch,
# never by the whole collective. runtime/transport/quant.py `ROWS_AT_ONCE` reads this bound. 2^20
# elements (4 MiB fp32 copies), not 2^24: larger copies came back from the OS as fresh
# pages at every call (runtime/transport/quant.py [Note: the codec batch's size]).
