"""GGUF export of the mixture-of-experts families llama.cpp runs (weights/gguf_export.py).

- Qwen3-MoE (llama.cpp's `qwen3moe`): the file loads in transformers' own GGUF reader (an
  independent reader, PyTorch) as a `Qwen3MoeForCausalLM` with our logits (f32 storage: 1e-4;
  f16: 5e-3 of the largest logit) and greedy tokens. transformers' reader takes the experts'
  width from Qwen3MoeConfig's default (768: it reads no `expert_feed_forward_length`), so the
  tiny model's experts are 768 wide.
- Mixtral (llama.cpp's `llama` with experts): no reader here runs it (transformers reads a
  `llama` GGUF as a dense Llama), so the file is checked against a transformers-saved Mixtral
  checkpoint: gguf's own reader finds llama.cpp's tensor names (gguf.MODEL_TENSORS[LLAMA]) with
  the experts of each layer stacked in order, Q/K rows in llama.cpp's interleaved RoPE order,
  and the expert metadata.
"""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from gguf import GGUFReader
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
from gguf.quants import dequantize

from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.models.tokenizer import train_bpe_tokenizer
from jaxrl_llm.weights.gguf_export import GGUFExportError, permute_qk_rows, write_gguf
from jaxrl_llm.weights.hf import load_pretrained

from .tiny_hf import make_hf_model, moe_hf_configs, save_hf

TEXTS = ["What is 12 + 7? The answer is 19.", "hello world", "3 * (4 - 1) = 9"]
PROMPT = np.array([[1, 40, 41, 60, 75, 90, 120, 200]], np.int64)


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(TEXTS * 10, 300)


def _qwen3_moe(**overrides) -> DecoderConfig:
    fields = dict(family="qwen3_moe", vocab_size=320, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768,
                  rms_norm_eps=1e-6, rope_theta=10_000.0, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2)
    return DecoderConfig(**{**fields, **overrides})


def _logits(model: Decoder, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, t: m.logits(m(t)))(model, tokens.astype(np.int32)))


@pytest.mark.parametrize("gguf_type, tol", [("f32", 1e-4),
                                             pytest.param("f16", 5e-3, marks=pytest.mark.slow)])
def test_qwen3_moe_gguf_loads_in_transformers_with_our_logits(tmp_path, tokenizer, gguf_type,
                                                             tol):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = Decoder(_qwen3_moe(), rngs=nnx.Rngs(0))
    # a router that really chooses (the 0.02-std init makes every token's scores alike)
    for layer in model.layers:
        layer.mlp.router[...] = layer.mlp.router[...] * 50.0
    path = write_gguf(model, tmp_path / f"m-{gguf_type}.gguf", tokenizer=tokenizer,
                      gguf_type=gguf_type)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    assert theirs.config.num_experts == 4 and theirs.config.norm_topk_prob
    want = _logits(model, PROMPT)
    with torch.no_grad():
        got = theirs(torch.from_numpy(PROMPT)).logits.numpy()
        greedy = theirs.generate(torch.from_numpy(PROMPT), max_new_tokens=5, do_sample=False,
                                 attention_mask=torch.ones_like(torch.from_numpy(PROMPT)),
                                 eos_token_id=None, pad_token_id=0)[0, PROMPT.shape[1]:]
    scale = np.abs(want).max()
    assert scale > 0.1
    np.testing.assert_allclose(got, want, atol=tol * scale)
    # our greedy continuation: full forwards over one fixed-length buffer (causal: the padding
    # after position t does not change the logits at t), so it compiles once
    n = PROMPT.shape[1]
    seq = np.concatenate([PROMPT, np.zeros((1, 5), PROMPT.dtype)], axis=1)
    for t in range(n, n + 5):
        seq[0, t] = int(np.argmax(_logits(model, seq)[0, t - 1]))
    assert greedy.tolist() == seq[0, n:].tolist()
    names = {t.name for t in GGUFReader(path).tensors}
    allowed = {TENSOR_NAMES[t].format(bid=b) + ".weight" for t in MODEL_TENSORS[MODEL_ARCH.QWEN3MOE]
               for b in range(2)}
    assert names <= allowed and "blk.1.ffn_gate_exps.weight" in names


def test_mixtral_gguf_holds_the_checkpoints_experts_in_llama_cpp_layout(tmp_path, tokenizer):
    pytest.importorskip("torch")
    config = moe_hf_configs()["mixtral"]
    config.vocab_size = 320
    hf_dir = save_hf(make_hf_model(config), tmp_path / "hf")
    path = write_gguf(load_pretrained(hf_dir), tmp_path / "mixtral.gguf", tokenizer=tokenizer,
                      gguf_type="f32")
    theirs = safetensors.numpy.load_file(str(hf_dir / "model.safetensors"))
    reader = GGUFReader(path)
    tensors = {t.name: dequantize(t.data, t.tensor_type).reshape(
        tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors}
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.architecture"] == "llama"
    assert (fields["llama.expert_count"], fields["llama.expert_used_count"],
            fields["llama.feed_forward_length"]) == (4, 2, 32)
    allowed = {TENSOR_NAMES[t].format(bid=b) + ".weight" for t in MODEL_TENSORS[MODEL_ARCH.LLAMA]
               for b in range(2)}
    assert set(tensors) - {"token_embd.weight", "output_norm.weight", "output.weight"} <= allowed
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        for ours, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            stacked = np.stack([theirs[f"{prefix}block_sparse_moe.experts.{e}.{w}.weight"]
                                for e in range(4)])
            np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_{ours}_exps.weight"], stacked)
        np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_gate_inp.weight"],
                                      theirs[f"{prefix}block_sparse_moe.gate.weight"])
        np.testing.assert_array_equal(tensors[f"blk.{layer}.attn_q.weight"], permute_qk_rows(
            theirs[f"{prefix}self_attn.q_proj.weight"], 4))
        np.testing.assert_array_equal(tensors[f"blk.{layer}.attn_k.weight"], permute_qk_rows(
            theirs[f"{prefix}self_attn.k_proj.weight"], 2))


@pytest.mark.parametrize("overrides, named", [
    (dict(norm_topk_prob=False), "norm_topk_prob=false"),
    (dict(family="qwen2_moe", qk_norm=False, qkv_bias=True, shared_expert_intermediate_size=64),
     "not supported for architecture 'qwen2_moe'"),
])
def test_moe_gguf_llama_cpp_would_compute_differently_is_refused(tmp_path, tokenizer,
                                                                 overrides, named):
    model = nnx.eval_shape(lambda: Decoder(_qwen3_moe(**overrides), rngs=nnx.Rngs(0)))
    with pytest.raises(GGUFExportError, match=named):
        write_gguf(model, tmp_path / "x.gguf", tokenizer=tokenizer, gguf_type="f16")
    assert not (tmp_path / "x.gguf").exists()
