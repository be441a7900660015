"""All-to-all reduce-scatters, their local halves — stage: runtime (both executors).

Input: what an all-to-all delivered (s rows, row j of every peer's chunk j), or the s
chunks a rank is about to send. Output: the reduce-scatter's local work, written once for
both executors: `sum_rows`, the sum of the rows received in a reduce-scatter stage on gloo
(eager/collectives.py [Note: reduce-scatter on gloo]), accumulated in fp32 for 16-bit comm dtypes;
`qgz_send` / `qgz_sum`, qgZ's quantized reduce-scatter around its one all-to-all: each of
the s chunks quantized into a uint8 payload row (runtime/transport/quant.py [Note: payload layout]),
then the s payloads received dequantized and summed in fp32.

[Note: one reduce-scatter, two executors]
The eager runtime (eager/collectives.py) issues the all-to-all with torch.distributed and runs
these on its result when the handle is waited; the whole-step mode (graph/funcol.py) issues it
as a functional collective in a compiled graph and calls the same functions, the qgZ ones
as opaque custom ops (graph/quant_ops.py [Note: why opaque]). Only the exchange differs, so the
two executors sum the same rows in the same order.
"""
from __future__ import annotations

import torch

from shardc.dsl.ir import DType

from . import quant


def sum_rows(parts: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The sum of the rows of `parts` (s, m) received by one reduce-scatter stage, into `out`
    when given; a 16-bit dtype is summed in fp32 and cast back."""
    if parts.dtype in (torch.float16, torch.bfloat16):
        total = parts.float().sum(0)
        return total.to(parts.dtype) if out is None else out.copy_(total)
    return parts.sum(0) if out is None else torch.sum(parts, 0, out=out)


def qgz_send(inp: torch.Tensor, s: int, dtype: DType, out: torch.Tensor | None = None) -> torch.Tensor:
    """qgZ's send buffer: each of the s chunks of `inp` (flat, s·m) a uint8 payload row (s, p)."""
    m = inp.numel() // s
    if out is None:
        out = inp.new_empty(s, quant.shard_payload_bytes(m, dtype), dtype=torch.uint8)
    for lo, hi in quant.row_batches(s, m, inp.device):     # rows at once: runtime/transport/quant.py
        quant.quantize_rows(inp.view(s, m)[lo:hi], dtype, out=out[lo:hi])
    return out


def qgz_sum(recv: torch.Tensor, m: int, dtype: DType) -> torch.Tensor:
    """The fp32 sum of the s payload rows `recv` (s, p) received by qgZ's all-to-all: this
    rank's m-element chunk of the reduce-scatter. The rows are decoded a batch at a time into
    one reused buffer; a batch of one row is added as it is (its `sum(0)` would be a copy),
    a batch of several is summed first (operators per batch, not per rank)."""
    s = recv.shape[0]
    acc = torch.zeros(m, dtype=torch.float32, device=recv.device)
    batches = quant.row_batches(s, m, recv.device)
    vals = torch.empty(max(hi - lo for lo, hi in batches), m, dtype=torch.float32, device=recv.device)
    for lo, hi in batches:
        rows = quant.dequantize_rows(recv[lo:hi], m, dtype, out=vals[:hi - lo])
        acc += rows[0] if hi - lo == 1 else rows.sum(0)
    return acc
