"""Decoder numerics against transformers' PyTorch models (the second implementation).

Every family's tiny random checkpoint is saved by transformers, loaded by our
`load_pretrained`, and must give the same logits (fp32, 1e-4) on a right-padded batch; the
scanned + rematerialised variant must agree too. Packed segments and the KV cache are checked
against separate / full forwards of the same model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")

from jaxrl_llm.models.decoder import Decoder, logical_axes
from jaxrl_llm.weights.hf import load_pretrained

from .tiny_hf import (
    hf_configs,
    hf_logits,
    make_hf_model,
    padded_batch,
    save_hf,
)

ATOL = 1e-4
CONFIGS = hf_configs()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (torch model, saved directory), built once for the module."""
    out = {}
    for name, config in CONFIGS.items():
        model = make_hf_model(config)
        out[name] = (model, save_hf(model, tmp_path_factory.mktemp(name)))
    return out


def _our_logits(model: Decoder, tokens, mask) -> np.ndarray:
    hidden = model(jnp.asarray(tokens), segment_ids=jnp.asarray(mask))
    return np.asarray(model.logits(hidden))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(checkpoints, name):
    torch_model, path = checkpoints[name]
    tokens, mask = padded_batch()
    ref = hf_logits(torch_model, tokens, mask)
    ours = _our_logits(load_pretrained(path), tokens, mask)
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 0.5  # logits are not trivially small
    np.testing.assert_allclose(ours[real], ref[real], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "name,scan,remat",
    [("gemma2", True, "dots"), ("llama3_tied", True, "full"),
     ("mistral_window", False, "dots_no_batch")],
)
def test_scan_and_remat_match_transformers(checkpoints, name, scan, remat):
    torch_model, path = checkpoints[name]
    tokens, mask = padded_batch()
    ref = hf_logits(torch_model, tokens, mask)
    model = load_pretrained(path, scan_layers=scan, remat=remat)
    layers = CONFIGS[name].num_hidden_layers
    if scan:  # one stacked Block
        assert model.layers.attn.q.shape == (layers, 64, 4, 16)
    else:
        assert len(model.layers) == layers
    ours = _our_logits(model, tokens, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=ATOL, rtol=0)


@pytest.mark.slow
def test_bfloat16_compute_is_close_to_float32(checkpoints):
    """bf16 activations (norms and softmax still fp32) stay near the fp32 logits."""
    torch_model, path = checkpoints["qwen2_bias"]
    tokens, mask = padded_batch()
    ref = hf_logits(torch_model, tokens, mask)
    model = load_pretrained(path, dtype="bfloat16", compute_dtype="bfloat16")
    assert model.embed[...].dtype == jnp.bfloat16
    hidden = model(jnp.asarray(tokens), segment_ids=jnp.asarray(mask))
    assert hidden.dtype == jnp.bfloat16
    ours = np.asarray(model.logits(hidden))
    real = mask.astype(bool)
    assert np.abs(ours[real] - ref[real]).max() < 0.1 * np.abs(ref[real]).max()


def test_sliding_window_is_exercised(checkpoints):
    """Negative control: without the window, Mistral's logits differ beyond the window."""
    torch_model, path = checkpoints["mistral_window"]
    tokens, mask = padded_batch()
    ref = hf_logits(torch_model, tokens, mask)
    model = load_pretrained(path, sliding_window=None)
    ours = _our_logits(model, tokens, mask)
    assert np.abs(ours[0, 6:] - ref[0, 6:]).max() > 1e-2
    np.testing.assert_allclose(ours[0, :4], ref[0, :4], atol=ATOL, rtol=0)


@pytest.mark.slow
def test_remat_gradients_equal_plain(checkpoints):
    """Remat and scan change memory, not math: same loss gradient as the unrolled model."""
    _, path = checkpoints["qwen3_qknorm"]
    tokens, mask = padded_batch()

    def grad_of(model):
        from flax import nnx

        graphdef, state = nnx.split(model)

        @jax.jit
        def grad(state):
            def loss(state):
                m = nnx.merge(graphdef, state)
                return jnp.sum(m(jnp.asarray(tokens), segment_ids=jnp.asarray(mask)) ** 2)

            return jax.grad(loss)(state)

        return grad(state)

    plain = grad_of(load_pretrained(path))
    scanned = grad_of(load_pretrained(path, scan_layers=True, remat="dots_no_batch"))
    unrolled = grad_of(load_pretrained(path, remat="full"))
    pairs = [(scanned["layers"]["attn"]["q"][...][1], plain["layers"][1]["attn"]["q"][...]),
             (scanned["embed"][...], plain["embed"][...]),
             (unrolled["layers"][0]["mlp"]["down"][...], plain["layers"][0]["mlp"]["down"][...])]
    for got, want in pairs:
        want = np.asarray(want)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.abs(want).max())


def test_packed_segments_equal_separate_sequences(checkpoints):
    """A row packing two sequences (segment ids 1, 2; positions restarting) + padding gives
    each sequence's hidden states of running it alone (Gemma 2: window + soft-caps)."""
    _, path = checkpoints["gemma2"]
    model = load_pretrained(path)
    rng = np.random.RandomState(1)
    a, b = rng.randint(3, 256, 6), rng.randint(3, 256, 4)
    # Row 0 packs a and b; rows 1 and 2 hold a and b alone (right-padded to the same length).
    tokens = np.zeros((3, 12), np.int32)
    segments = np.zeros((3, 12), np.int32)
    positions = np.zeros((3, 12), np.int32)
    tokens[0, :10] = np.concatenate([a, b])
    segments[0, :10] = [1] * 6 + [2] * 4
    positions[0, :10] = list(range(6)) + list(range(4))
    tokens[1, :6], segments[1, :6], positions[1, :6] = a, 1, np.arange(6)
    tokens[2, :4], segments[2, :4], positions[2, :4] = b, 1, np.arange(4)
    hidden = np.asarray(model(jnp.asarray(tokens), positions=jnp.asarray(positions),
                              segment_ids=jnp.asarray(segments)))
    np.testing.assert_allclose(hidden[0, :6], hidden[1, :6], atol=1e-5, rtol=0)
    np.testing.assert_allclose(hidden[0, 6:10], hidden[2, :4], atol=1e-5, rtol=0)
    # Control: without segment ids, b's tokens see a's and the states differ.
    mixed = np.asarray(model(jnp.asarray(tokens), positions=jnp.asarray(positions)))
    assert np.abs(mixed[0, 6:10] - hidden[2, :4]).max() > 1e-3


@pytest.mark.parametrize(
    "name,scan",
    [("llama3_tied", False), pytest.param("gemma2", True, marks=pytest.mark.slow)],
)
def test_kv_cache_decode_equals_full_forward(checkpoints, name, scan):
    """Left-padded prompts, prefill + 3 one-token steps == one full forward of the sequence
    with the same padding mask and positions (cumsum of the mask, as documented)."""
    _, path = checkpoints[name]
    model = load_pretrained(path, scan_layers=scan)
    rng = np.random.RandomState(2)
    prompt = rng.randint(3, 256, (2, 6)).astype(np.int32)
    prompt_mask = np.ones((2, 6), np.int32)
    prompt_mask[1, :3] = 0  # row 1 left-padded
    new = rng.randint(3, 256, (2, 3)).astype(np.int32)

    cache = model.init_cache(2, 12, jnp.float32)
    prefill = jax.jit(lambda m, t, s, c: m(t, segment_ids=s, cache=c))
    hidden, cache = prefill(model, jnp.asarray(prompt), jnp.asarray(prompt_mask), cache)
    step_hidden = [np.asarray(hidden)]
    decode = jax.jit(lambda m, t, c: m(t, cache=c))
    for k in range(3):
        h, cache = decode(model, jnp.asarray(new[:, k:k + 1]), cache)
        step_hidden.append(np.asarray(h))
    incremental = np.concatenate(step_hidden, axis=1)

    full_tokens = np.concatenate([prompt, new], axis=1)
    full_mask = np.concatenate([prompt_mask, np.ones((2, 3), np.int32)], axis=1)
    positions = np.maximum(np.cumsum(full_mask, axis=1) - 1, 0)
    full = np.asarray(model(jnp.asarray(full_tokens), positions=jnp.asarray(positions),
                            segment_ids=jnp.asarray(full_mask)))
    real = full_mask.astype(bool)
    np.testing.assert_allclose(incremental[real], full[real], atol=1e-5, rtol=0)
    assert int(cache.index) == 9
    np.testing.assert_array_equal(np.asarray(cache.lengths), [9, 6])


def test_every_parameter_has_logical_axes(checkpoints):
    from flax import nnx

    allowed = {"vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "norm", "layers"}
    for scan in (False, True):
        model = load_pretrained(checkpoints["gemma2"][1], scan_layers=scan)
        is_axes = lambda x: isinstance(x, tuple)
        axes = jax.tree_util.tree_flatten_with_path(logical_axes(model), is_leaf=is_axes)[0]
        values = jax.tree.leaves(nnx.state(model, nnx.Param))
        # embed, final norm + 11 per Gemma 2 layer (4 norms, q k v o, gate up down)
        assert len(axes) == len(values) == 2 + 11 * (1 if scan else 3)
        for (path, names), value in zip(axes, values, strict=True):
            assert len(names) == value.ndim and set(names) <= allowed, path
            in_layers = str(path[0]).find("layers") >= 0
            assert (names[0] == "layers") == (scan and in_layers), path
    model = load_pretrained(checkpoints["qwen2_bias"][1])
    axes = logical_axes(model)
    assert axes["embed"] == ("vocab", "embed")
    assert axes["lm_head"] == ("vocab", "embed")
    assert axes["layers"][0]["attn"]["k"] == ("embed", "kv_heads", "head_dim")
    assert axes["layers"][0]["attn"]["q_bias"] == ("q_heads", "head_dim")
    assert axes["layers"][1]["mlp"]["down"] == ("mlp", "embed")
    assert axes["final_norm"]["scale"] == ("norm",)
