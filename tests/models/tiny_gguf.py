"""A tiny llama.cpp GGUF file written from a tiny Hugging Face Llama, for tests.

The weights are stored as F32 in llama.cpp's layout: Q and K rows permuted for its
interleaved RoPE (as `convert_hf_to_gguf.py` does), names `blk.N.*`, shapes in ggml order
(the writer reverses numpy's). A toy byte-level BPE vocabulary stands in for the tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "Ġ", "1", "2", "ab", "Ġab"]
MERGES = ["a b", "Ġ ab"]

_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def tiny_llama_config():
    """An untied Llama without RoPE scaling (what GGUF's `llama` architecture holds)."""
    import transformers as tf

    return tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128, initializer_range=0.1, bos_token_id=1,
                          eos_token_id=2, rms_norm_eps=1e-6, rope_theta=10_000.0,
                          tie_word_embeddings=False)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter `permute` (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(hf_model, path: Path) -> Path:
    """`hf_model` (a transformers LlamaForCausalLM) as an F32 GGUF file at `path`."""
    import gguf

    c = hf_model.config
    tensors = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", tensors["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", tensors["model.norm.weight"])
    writer.add_tensor("output.weight", tensors["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        for hf_name, gguf_name in _BLOCK.items():
            w = tensors[f"model.layers.{i}.{hf_name}"]
            if gguf_name == "attn_q.weight":
                w = llama_cpp_permute(w, c.num_attention_heads)
            elif gguf_name == "attn_k.weight":
                w = llama_cpp_permute(w, c.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
