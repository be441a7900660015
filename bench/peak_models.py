"""Small Hugging Face causal LMs for the peak sweep (bench/peak_sweep.py): GPT-2 and Llama
from configs (no weights), built on whatever device is current (the meta one under
`shardc simulate`). Dropout off, as tests/test_hf_models.py has it."""
from __future__ import annotations

V = 512


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=128, n_embd=128, n_layer=4, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def llama_small():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def llama_836m_small():
    """The 836M model's units at a test's size (tests/test_peak_fsdp2.py): two decoder layers,
    the untied embedding and head (4096 x 256) the largest units, as the 836M model's are;
    `use_cache` on as in `llama_836m`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=704, vocab_size=4096,
                                        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                        tie_word_embeddings=False, use_cache=True, max_position_embeddings=128))


def llama_836m():
    """bench/bigmodel.py's 836M Llama (16 layers of TinyLlama's width, fp32) with HF's
    `use_cache` on: without it HF's packed-sequence check reads a value, which a simulated
    rank's meta tensors have not (bench/peak_fsdp2.py --simulate-836m)."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bigmodel
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=16, **dict(bigmodel.WIDTH, use_cache=True)))
