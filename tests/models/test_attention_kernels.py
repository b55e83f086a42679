"""The fused attention implementations (models/attention.py) against today's jnp attention.

Every implementation must give the jnp path's values and gradients on real (non-padding)
tokens for causal GQA, right padding, packed segments, Gemma 2's sliding window and logit
soft-cap. Splash runs in Pallas' interpret mode on this CPU; "cudnn" resolves to the same
`jax.nn.dot_product_attention` call with implementation="xla" here (same arguments).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models.attention import resolve, self_attention
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.models.layers import attention_mask, dot_product_attention

B, T, HQ, HKV, D = 2, 128, 4, 2, 32
SCALE = D ** -0.5


def _segments(kind: str) -> np.ndarray:
    seg = np.ones((B, T), np.int32)
    if kind == "padded":  # right padding: row 0 has 100 real tokens, row 1 has 37
        seg[0, 100:] = 0
        seg[1, 37:] = 0
    elif kind == "left":  # left padding: must not take the unmasked one-sequence path
        seg[0, :20] = 0
        seg[1, :50] = 0
    elif kind == "packed":  # row 0: three records then padding; row 1: two records
        seg[0, :40], seg[0, 40:90], seg[0, 90:120], seg[0, 120:] = 1, 2, 3, 0
        seg[1, :70], seg[1, 70:] = 1, 2
    return seg


def _positions(seg: np.ndarray) -> np.ndarray:
    """Positions restarting at 0 in each segment (what the packing loader writes)."""
    pos = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        for t in range(1, seg.shape[1]):
            pos[b, t] = pos[b, t - 1] + 1 if seg[b, t] == seg[b, t - 1] else 0
    return pos


def _reference(q, k, v, seg, window, softcap):
    pos = jnp.asarray(_positions(np.asarray(seg)))
    slots = jnp.arange(T, dtype=jnp.int32)
    mask = attention_mask(seg, pos, slots, seg, pos, slots, window)
    return dot_product_attention(q, k, v, mask, scale=SCALE, logit_softcap=softcap)


def _brute_force(q, k, v, seg, window, softcap):
    """Loops over rows, heads and queries in numpy (float64)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    out = np.zeros_like(q)
    g = HQ // HKV
    for b, h, t in itertools.product(range(B), range(HQ), range(T)):
        if seg[b, t] == 0:
            continue
        keys = [s for s in range(t + 1) if seg[b, s] == seg[b, t]
                and (window is None or t - s < window)]
        logits = np.array([q[b, t, h] @ k[b, s, h // g] * SCALE for s in keys])
        if softcap is not None:
            logits = softcap * np.tanh(logits / softcap)
        p = np.exp(logits - logits.max())
        out[b, t, h] = (p / p.sum()) @ v[b, keys, h // g]
    return out


def _inputs(seed: int = 0):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, T, HQ, D), jnp.float32)
    k = jax.random.normal(kk, (B, T, HKV, D), jnp.float32)
    v = jax.random.normal(kv, (B, T, HKV, D), jnp.float32)
    cot = jax.random.normal(kc, (B, T, HQ, D), jnp.float32)
    return q, k, v, cot


CASES = [  # (segments, window, softcap)
    ("full", None, None),
    ("padded", None, None),
    ("left", None, None),
    ("packed", None, None),
    ("packed", 24, None),
    ("padded", 24, 50.0),
    ("full", 300, 5.0),  # a window longer than the row is plain causal attention
]


# Splash in interpret mode takes seconds per case on 2 cores: two cases cover segments, window
# and soft-cap in the default suite, the rest are slow-marked.
_FAST_SPLASH = {("packed", 24, None), ("padded", 24, 50.0)}
PARAMS = [
    pytest.param(impl, *case, marks=[pytest.mark.slow]
                 if impl == "splash" and case not in _FAST_SPLASH else [])
    for impl in ("xla", "cudnn", "splash") for case in CASES
]


@pytest.mark.parametrize("implementation,segments,window,softcap", PARAMS)
def test_implementation_matches_jnp_attention_values_and_gradients(
    implementation: str, segments: str, window: int | None, softcap: float | None
) -> None:
    q, k, v, cot = _inputs()
    seg = jnp.asarray(_segments(segments))
    real = (seg != 0)[:, :, None, None]
    cot = jnp.where(real, cot, 0.0)  # losses read real tokens only

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * cot)

    ref_fn = lambda q, k, v: _reference(q, k, v, seg, window, softcap)
    new_fn = lambda q, k, v: self_attention(
        q, k, v, seg, scale=SCALE, logit_softcap=softcap, window=window,
        is_local=window is not None, implementation=implementation)
    ref_out, new_out = ref_fn(q, k, v), new_fn(q, k, v)
    np.testing.assert_allclose(np.where(real, new_out, 0), np.where(real, ref_out, 0),
                               atol=2e-5, rtol=2e-5)
    ref_grads = jax.grad(loss, argnums=(1, 2, 3))(ref_fn, q, k, v)
    new_grads = jax.grad(loss, argnums=(1, 2, 3))(new_fn, q, k, v)
    for name, r, n in zip("qkv", ref_grads, new_grads):
        np.testing.assert_allclose(n, r, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")


def test_reference_matches_a_brute_force_loop() -> None:
    """Anchor: the jnp path itself against per-query numpy loops (packed, window, soft-cap)."""
    q, k, v, _ = _inputs(1)
    seg = _segments("packed")
    got = _reference(q, k, v, jnp.asarray(seg), 24, 5.0)
    want = _brute_force(q, k, v, seg, 24, 5.0)
    real = (seg != 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, got, 0), want, atol=1e-5)


def test_traced_layer_choice_selects_the_window() -> None:
    """Under a layer scan `is_local` is traced: both branches exist, the right one runs."""
    q, k, v, _ = _inputs(2)
    seg = jnp.asarray(_segments("packed"))
    run = jax.jit(lambda local: self_attention(q, k, v, seg, scale=SCALE, window=24,
                                               is_local=local, implementation="splash"))
    real = np.asarray(seg != 0)[:, :, None, None]
    for local in (True, False):
        want = _reference(q, k, v, seg, 24 if local else None, None)
        np.testing.assert_allclose(np.where(real, run(jnp.asarray(local)), 0),
                                   np.where(real, want, 0), atol=2e-5)


@pytest.mark.parametrize("segments", ["padded", "packed"])
def test_xla_path_on_batch_sharded_rows(segments: str) -> None:
    """The one-sequence test (`lax.cond` over the whole batch) on rows split over 8 devices:
    the same values as on one device, for both of its branches."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    q, k, v, _ = (jnp.tile(a, (4, 1, 1, 1)) for a in _inputs(4))  # 8 rows
    seg = jnp.tile(jnp.asarray(_segments(segments)), (4, 1))
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    run = jax.jit(lambda q, k, v, seg: self_attention(q, k, v, seg, scale=SCALE,
                                                      implementation="xla"))
    want = run(q, k, v, seg)
    got = run(*(jax.device_put(a, rows) for a in (q, k, v, seg)))
    assert got.sharding.spec[0] == "data"
    np.testing.assert_allclose(got, want, atol=1e-6)
    real = np.asarray(seg != 0)[:, :, None, None]
    ref = _reference(q[:2], k[:2], v[:2], seg[:2], None, None)
    np.testing.assert_allclose(np.where(real[:2], got[:2], 0), np.where(real[:2], ref, 0),
                               atol=2e-5)


def _relative_error(got, want, real) -> float:
    got, want = (np.where(real, np.asarray(a, np.float64), 0.0) for a in (got, want))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN runs on an NVIDIA GPU only")
@pytest.mark.parametrize("segments,window", [("full", None), ("padded", None), ("left", None),
                                             ("packed", None), ("packed", 24)])
def test_cudnn_kernel_on_gpu_matches_jnp_attention_in_bf16(segments: str,
                                                           window: int | None) -> None:
    """On a GPU "cudnn" must compile to cuDNN's fused attention (not a fallback) and give the
    jnp path's values and gradients, the jnp path run in float32 on the same bf16 inputs."""
    q, k, v, cot = (a.astype(jnp.bfloat16) for a in _inputs(3))
    seg = jnp.asarray(_segments(segments))
    real = np.asarray(seg != 0)[:, :, None, None]
    cot = jnp.where(real, cot, 0)

    def new_fn(q, k, v):
        return self_attention(q, k, v, seg, scale=SCALE, window=window,
                              is_local=window is not None, implementation="cudnn")

    def ref_fn(q, k, v):
        return _reference(*(a.astype(jnp.float32) for a in (q, k, v)), seg, window, None)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * cot.astype(jnp.float32))

    hlo = jax.jit(new_fn).lower(q, k, v).compile().as_text()
    assert "__cudnn$fmha" in hlo, "cuDNN's fused attention is not in the compiled program"
    assert _relative_error(new_fn(q, k, v), ref_fn(q, k, v), real) < 1e-2
    new_grads = jax.jit(jax.grad(lambda *a: loss(new_fn, *a), argnums=(0, 1, 2)))(q, k, v)
    ref_grads = jax.grad(lambda *a: loss(ref_fn, *a), argnums=(0, 1, 2))(q, k, v)
    for name, n, r in zip("qkv", new_grads, ref_grads):
        err = _relative_error(n, r, np.ones_like(real) if name != "q" else real)
        assert err < 2e-2, f"d{name}: relative error {err:.3g}"


def test_resolve_by_platform_and_unsupported_cases() -> None:
    assert resolve("auto", platform="tpu") == "splash"
    assert resolve("auto", platform="gpu", dtype=jnp.bfloat16) == "cudnn"
    assert resolve("auto", platform="cpu") in ("jnp", "xla")
    # cuDNN has no soft-cap and needs half precision: the explicit-mask and XLA paths run.
    assert resolve("cudnn", platform="gpu", dtype=jnp.bfloat16, logit_softcap=50.0) == "jnp"
    assert resolve("cudnn", platform="gpu", dtype=jnp.float32) == "xla"
    assert resolve("xla", platform="cpu", logit_softcap=50.0) == "jnp"
    with pytest.raises(ValueError, match="model.attention='flash'"):
        resolve("flash")


@pytest.mark.slow  # ≈ 10 s in Pallas interpret mode; the splash kernel itself is checked in the default run
@pytest.mark.parametrize("scan_layers", [False, True])
def test_decoder_with_splash_matches_jnp_gemma2(scan_layers: bool) -> None:
    """A Gemma 2 decoder (local/global layers, soft-caps) on packed rows: same hidden states
    and parameter gradients with splash (interpret mode) as with the jnp path."""
    base = DecoderConfig(family="gemma2", vocab_size=97, hidden_size=64, intermediate_size=96,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         sliding_window=24, layer_types=("sliding_attention", "full_attention"),
                         attn_logit_softcap=20.0, final_logit_softcap=30.0,
                         hidden_act="gelu_tanh", tie_embeddings=True,
                         scan_layers=scan_layers, attention="jnp")
    seg = jnp.asarray(_segments("packed"))
    pos = jnp.asarray(_positions(np.asarray(seg)))
    tokens = jax.random.randint(jax.random.key(3), (B, T), 0, 97)
    real = (seg != 0)[:, :, None]

    def run(config):
        model = Decoder(config, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(params):
            hidden = nnx.merge(graphdef, params)(tokens, positions=pos, segment_ids=seg)
            return jnp.sum(jnp.where(real, hidden, 0.0) ** 2), hidden

        (_, hidden), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return hidden, grads

    ref_h, ref_g = run(base)
    new_h, new_g = run(base.replace(attention="splash"))
    np.testing.assert_allclose(np.where(real, new_h, 0), np.where(real, ref_h, 0),
                               atol=1e-4, rtol=1e-4)
    for (path, r), n in zip(jax.tree_util.tree_leaves_with_path(ref_g),
                            jax.tree.leaves(new_g)):
        np.testing.assert_allclose(n, r, atol=2e-4, rtol=2e-3,
                                   err_msg=jax.tree_util.keystr(path))


def test_model_attention_key_is_validated() -> None:
    from jaxrl_llm.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.attention"):
        load_config(None, ["model.attention=flash"])
    assert load_config(None, ["model.attention=splash"]).model.attention == "splash"
