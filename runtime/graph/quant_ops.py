"""Quantization as custom ops — stage: runtime (the whole-step mode's qwZ / qgZ codecs).

Input: a 1-D float tensor and the bits (8 or 4) of a quantized wire dtype. Output:
`torch.ops.shardc.encode` (codes, fp32 block scales) and `torch.ops.shardc.decode` (the
float32 values back), runtime/transport/quant.py's `encode` / `decode` as opaque ops, so Inductor
calls them as they are inside a compiled graph.

[Note: why opaque]
Compiled by Inductor's CPU backend, the codec's blockwise absmax (a reduction whose
result divides the same blocks) gave wrong values whenever its output went straight into a
functional collective (seen with torch 2.13: every code of an all-gathered int8 payload
off by up to 254 while the same graph returning the codes was exact). As custom ops the
codec runs its eager kernels; the collectives around it stay functional collectives in the
graph, compiled by Inductor.
"""
from __future__ import annotations

from math import ceil

import torch

from shardc.dsl.ir import DType
from shardc.lowering import BLOCK, code_bytes

from ..transport import a2a, quant

BITS = {8: DType.INT8, 4: DType.INT4}


@torch.library.custom_op("shardc::encode", mutates_args=())
def encode(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = quant.encode(x, BITS[bits])
    return codes.clone(), scales.clone()


@encode.register_fake
def _(x, bits):
    m = x.numel()
    dtype = torch.int8 if bits == 8 else torch.uint8
    return x.new_empty(code_bytes(m, BITS[bits]), dtype=dtype), x.new_empty(ceil(m / BLOCK), dtype=torch.float32)


@torch.library.custom_op("shardc::decode", mutates_args=())
def decode(codes: torch.Tensor, scales: torch.Tensor, m: int, bits: int) -> torch.Tensor:
    return quant.decode(codes, scales, m, BITS[bits]).clone()


@decode.register_fake
def _(codes, scales, m, bits):
    return scales.new_empty(m, dtype=torch.float32)


@torch.library.custom_op("shardc::qgz_send", mutates_args=())
def qgz_send(x: torch.Tensor, s: int, bits: int) -> torch.Tensor:
    return a2a.qgz_send(x.reshape(-1), s, BITS[bits])


@qgz_send.register_fake
def _(x, s, bits):
    return x.new_empty(s, quant.shard_payload_bytes(x.numel() // s, BITS[bits]), dtype=torch.uint8)


@torch.library.custom_op("shardc::qgz_sum", mutates_args=())
def qgz_sum(recv: torch.Tensor, m: int, bits: int) -> torch.Tensor:
    return a2a.qgz_sum(recv, m, BITS[bits])


@qgz_sum.register_fake
def _(recv, m, bits):
    return recv.new_empty(m, dtype=torch.float32)
