"""Torch dtypes — stage: runtime. The one table from the strategy's `DType` to torch's.

Input: a `shardc.dsl.ir.DType` (fp32, bf16, fp16; int8/int4 are quantized payloads, held as
uint8 bytes by runtime/transport/quant.py). Output: the `torch.dtype` the runtime stores or
communicates it in.
"""
from __future__ import annotations

import torch

from shardc.dsl.ir import DType

TORCH_DTYPE = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


def torch_dtype(dtype: DType) -> torch.dtype:
    return TORCH_DTYPE[dtype]
