"""GPT-NeoX-20B-shaped decoder for `shardc explain` (ZeRO-topo's evaluation model).

`neox_20b` reuses the LLaMA-shaped blocks of `examples/llama.py` with GPT-NeoX-20B's
sizes: hidden 6144, 44 layers, 64 heads, vocabulary 50432. NeoX's GELU MLP of width
4·6144 has 2·6144·24576 weights; the SwiGLU here has the same count (3·6144·16384), so
parameters and matmul FLOPs match (20.5 B parameters; biases and the rotary fraction
aside). Build it on the meta device: nothing is allocated.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import Llama, LlamaConfig  # noqa: E402


def neox_20b() -> Llama:
    return Llama(LlamaConfig(dim=6144, n_layers=44, n_heads=64, ffn_dim=16384, vocab=50432, max_seq=2048))
