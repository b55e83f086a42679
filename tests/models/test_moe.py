"""Mixture-of-experts layer (models/moe.py, models/moe_dispatch.py) against independent
transcriptions: the dropless grouped-matmul dispatch against a dense brute force (every expert
on every token, weighted by the gates, in float64 numpy), the router against numpy's top-k,
routing replay, and both auxiliary losses against their equations (Switch Transformer
arXiv:2101.03961 eqs. 4-6 pooled over layers as transformers' `load_balancing_loss_func`;
ST-MoE arXiv:2202.08906 eq. 5). Parity with transformers is tests/models/test_moe_parity.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models.config import DecoderConfig, UnsupportedConfigError
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.models.moe import MoeStats, finish_aux, layer_stats, moe_forward
from jaxrl_llm.models.moe_dispatch import experts_local
from jaxrl_llm.weights.hf import load_pretrained, save_pretrained

E, K, D, F = 8, 2, 16, 12


def _config(**overrides) -> DecoderConfig:
    fields = dict(family="qwen3_moe", vocab_size=64, hidden_size=D, intermediate_size=24,
                  num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, num_experts=E,
                  num_experts_per_tok=K, moe_intermediate_size=F, qk_norm=True)
    return DecoderConfig(**{**fields, **overrides})


def _weights(seed: int = 0, e: int = E) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"router": rng.normal(size=(D, e)).astype(np.float32),
            "gate": (0.3 * rng.normal(size=(e, D, F))).astype(np.float32),
            "up": (0.3 * rng.normal(size=(e, D, F))).astype(np.float32),
            "down": (0.3 * rng.normal(size=(e, F, D))).astype(np.float32)}


def _silu(x):
    return x / (1.0 + np.exp(-x))


def brute_force(p, x, ids, gates) -> np.ndarray:
    """Every expert on every token (float64), combined with the gates scattered to [N, E]."""
    x = x.astype(np.float64)
    n, e = x.shape[0], p["gate"].shape[0]
    combine = np.zeros((n, e))
    for j in range(ids.shape[1]):
        combine[np.arange(n), ids[:, j]] += gates[:, j]
    out = np.zeros_like(x)
    for expert in range(e):
        h = _silu(x @ p["gate"][expert]) * (x @ p["up"][expert])
        out += combine[:, expert:expert + 1] * (h @ p["down"][expert])
    return out


def numpy_route(router, x, k, normalise):
    logits = x.astype(np.float64) @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    gates = np.take_along_axis(probs, ids, -1)
    if normalise:
        gates = gates / gates.sum(-1, keepdims=True)
    return ids, gates, logits, probs


@pytest.mark.parametrize("routing", ["random", "one_expert", "empty_experts"])
def test_dropless_dispatch_equals_dense_brute_force(routing):
    rng = np.random.default_rng(1)
    n = 40
    p = _weights()
    x = rng.normal(size=(n, D)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(n)]).astype(np.int32)
    if routing == "one_expert":  # every token's first choice is expert 3: no capacity limit
        ids[:, 0] = 3
        ids[:, 1] = np.where(ids[:, 1] == 3, 5, ids[:, 1])
    elif routing == "empty_experts":  # experts 0, 1, 6, 7 get no token
        ids = rng.choice([2, 3, 4, 5], size=(n, K), replace=True).astype(np.int32)
    gates = rng.uniform(0.1, 1.0, size=(n, K)).astype(np.float32)
    ours = experts_local(jax.tree.map(jnp.asarray, p), jnp.asarray(x), jnp.asarray(ids),
                         jnp.asarray(gates), _config())
    np.testing.assert_allclose(np.asarray(ours), brute_force(p, x, ids, gates), atol=2e-5,
                               rtol=1e-5)


def test_dispatch_gradients_equal_the_brute_force_gradients():
    rng = np.random.default_rng(2)
    n = 24
    p = jax.tree.map(jnp.asarray, _weights(3))
    x = jnp.asarray(rng.normal(size=(n, D)).astype(np.float32))
    ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(n)]).astype(np.int32))
    gates = jnp.asarray(rng.uniform(0.1, 1.0, size=(n, K)).astype(np.float32))
    target = jnp.asarray(rng.normal(size=(n, D)).astype(np.float32))

    def dense(p, x, gates):  # the brute force, in jnp so autodiff gives its gradient
        combine = jnp.einsum("nk,nke->ne", gates, jax.nn.one_hot(ids, E))
        h = jax.nn.silu(jnp.einsum("nd,edf->enf", x, p["gate"])) * jnp.einsum(
            "nd,edf->enf", x, p["up"])
        return jnp.einsum("end,ne->nd", jnp.einsum("enf,efd->end", h, p["down"]), combine)

    def loss(fn):
        return lambda p, x, g: jnp.sum((fn(p, x, g) - target) ** 2)

    ours = jax.grad(loss(lambda p, x, g: experts_local(p, x, ids, g, _config())),
                    argnums=(0, 1, 2))(p, x, gates)
    ref = jax.grad(loss(dense), argnums=(0, 1, 2))(p, x, gates)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("normalise", [True, False])
def test_layer_routes_top_k_and_combines_like_numpy(normalise):
    rng = np.random.default_rng(4)
    p = _weights(5)
    x = rng.normal(size=(2, 6, D)).astype(np.float32)
    c = _config(norm_topk_prob=normalise)
    y, stats = moe_forward(jax.tree.map(jnp.asarray, p), jnp.asarray(x), c,
                           jnp.ones((2, 6)))
    ids, gates, _, _ = numpy_route(p["router"], x.reshape(12, D), K, normalise)
    np.testing.assert_array_equal(np.asarray(stats.ids).reshape(12, K), ids)
    np.testing.assert_allclose(np.asarray(y).reshape(12, D),
                               brute_force(p, x.reshape(12, D), ids, gates), atol=2e-5)


def test_replay_takes_the_given_experts_with_gates_from_the_current_router():
    rng = np.random.default_rng(6)
    p = _weights(7)
    x = rng.normal(size=(1, 10, D)).astype(np.float32)
    c = _config()
    jp = jax.tree.map(jnp.asarray, p)
    y, stats = moe_forward(jp, jnp.asarray(x), c, jnp.ones((1, 10)))
    same, _ = moe_forward(jp, jnp.asarray(x), c, jnp.ones((1, 10)), routing=stats.ids)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(y))
    # Other experts (the two least likely): gates are their renormalised probabilities.
    _, _, _, probs = numpy_route(p["router"], x[0], K, True)
    other = np.argsort(probs, axis=-1)[:, :K].astype(np.int32)
    replayed, rstats = moe_forward(jp, jnp.asarray(x), c, jnp.ones((1, 10)),
                                   routing=jnp.asarray(other[None]))
    gates = np.take_along_axis(probs, other, -1)
    gates /= gates.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(rstats.ids[0]), other)
    np.testing.assert_allclose(np.asarray(replayed[0]), brute_force(p, x[0], other, gates),
                               atol=2e-5)


def test_aux_and_z_losses_follow_their_equations():
    """Two layers' logits over 3 rows with padding: transformers' pooled load-balancing loss
    E · Σ_e f_e P_e (f: top-k assignment fraction, P: mean probability, over both layers'
    real tokens) and ST-MoE's z-loss mean((log Σ exp z)²), transcribed in numpy."""
    rng = np.random.default_rng(8)
    layers, n = 2, 15
    logits = rng.normal(size=(layers, n, E)) * 2
    mask = np.ones(n)
    mask[[4, 9, 10]] = 0.0  # padding
    per_layer = []
    for layer in range(layers):
        probs = np.exp(logits[layer]) / np.exp(logits[layer]).sum(-1, keepdims=True)
        ids = np.argsort(-probs, -1)[:, :K]
        per_layer.append(layer_stats(jnp.asarray(ids, jnp.int32),
                                     jnp.asarray(logits[layer], jnp.float32),
                                     jnp.asarray(mask), E))
    stats = MoeStats(jnp.zeros((layers, 1, n, K), jnp.int32),
                     *(jnp.stack(parts) for parts in zip(*per_layer)))
    aux = finish_aux(stats, E)
    counts, prob_sum = np.zeros(E), np.zeros(E)
    for layer in range(layers):
        probs = np.exp(logits[layer]) / np.exp(logits[layer]).sum(-1, keepdims=True)
        for token in np.flatnonzero(mask):
            for expert in np.argsort(-probs[token])[:K]:
                counts[expert] += 1
            prob_sum += probs[token]
    rows = layers * mask.sum()
    expected_aux = E * np.sum((counts / rows) * (prob_sum / rows))
    lse = np.log(np.exp(logits).sum(-1))  # [L, n]
    expected_z = np.sum(lse ** 2 * mask) / rows
    np.testing.assert_allclose(float(aux.aux_loss), expected_aux, rtol=1e-5)
    np.testing.assert_allclose(float(aux.z_loss), expected_z, rtol=1e-5)
    # uniform routing is the minimum: E · Σ (k/E)(1/E) = k
    assert expected_aux > K


@pytest.mark.slow  # ≈ 20 s on 2 cores; the unrolled MoE decoder keeps its default-run tests
def test_scanned_remat_decoder_equals_unrolled_with_same_routing(tmp_path):
    unrolled = Decoder(_config(num_layers=3), rngs=nnx.Rngs(0))
    save_pretrained(unrolled, tmp_path)  # the same weights, stacked for the layer scan
    scanned = load_pretrained(tmp_path, scan_layers=True, remat="full")
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, 64, (2, 7)), jnp.int32)
    h1, a1 = unrolled(tokens, return_moe=True)
    h2, a2 = scanned(tokens, return_moe=True)
    assert a1.routing.shape == (3, 2, 7, K)
    np.testing.assert_array_equal(np.asarray(a1.routing), np.asarray(a2.routing))
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h2), atol=1e-5)
    np.testing.assert_allclose(float(a1.aux_loss), float(a2.aux_loss), rtol=1e-6)
    # replaying a decoder's own routing changes nothing
    h3, a3 = scanned(tokens, routing=a2.routing, return_moe=True)
    np.testing.assert_array_equal(np.asarray(h3), np.asarray(h2))


def test_kv_cache_decoding_equals_the_full_forward():
    """Prefill 4 tokens, then decode 3 one at a time: each step's logits and experts are the
    full forward's at that position (a MoE layer is per token)."""
    model = Decoder(_config(family="mixtral", num_experts=4, qk_norm=False), rngs=nnx.Rngs(1))
    tokens = jnp.asarray(np.random.default_rng(10).integers(0, 64, (2, 7)), jnp.int32)
    full, aux = nnx.jit(lambda m, t: m(t, return_moe=True))(model, tokens)
    run = nnx.jit(lambda m, t, cache: m(t, cache=cache, return_moe=True))
    hidden, cache, first = run(model, tokens[:, :4], model.init_cache(2, 8))
    steps, routes = [hidden], [first.routing]
    for t in range(4, 7):  # one compile for the three one-token steps
        hidden, cache, step = run(model, tokens[:, t:t + 1], cache)
        steps.append(hidden)
        routes.append(step.routing)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full),
                               atol=2e-5)
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(routes, 2)),
                                  np.asarray(aux.routing))


def test_top_k_larger_than_the_expert_count_is_refused():
    with pytest.raises(UnsupportedConfigError, match=r"num_experts_per_tok=9 \(top-k\) must "
                       r"be between 1 and num_experts=8"):
        _config(num_experts_per_tok=9)
    hf = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=24,
              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
              moe_intermediate_size=8, num_experts=4, num_experts_per_tok=5)
    with pytest.raises(UnsupportedConfigError, match=r"my/config.json: num_experts_per_tok=5"):
        DecoderConfig.from_hf(hf, source="my/config.json")


@pytest.mark.parametrize("fields, message", [
    (dict(family="llama", num_experts=4, num_experts_per_tok=2), "is dense"),
    (dict(num_experts=0, num_experts_per_tok=0), "needs num_experts >= 1"),
    (dict(family="mixtral", norm_topk_prob=False), "always renormalises"),
    (dict(shared_expert_intermediate_size=8), "shared expert"),
    (dict(family="qwen2_moe"), "shared expert"),
])
def test_inconsistent_expert_fields_are_refused(fields, message):
    with pytest.raises(UnsupportedConfigError, match=message):
        _config(**fields)


@pytest.mark.parametrize("field, value", [("mlp_only_layers", [0]),
                                          ("decoder_sparse_step", 2)])
def test_dense_layers_between_moe_layers_are_refused(field, value):
    hf = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=24,
              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, **{field: value})
    with pytest.raises(UnsupportedConfigError, match=f"field {field}="):
        DecoderConfig.from_hf(hf)


def test_lora_on_a_moe_takes_attention_targets_and_refuses_the_experts(tmp_path):
    from jaxrl_llm.models.lora import LoraSpec, add_lora

    with pytest.raises(ValueError, match="model.lora.targets: LoRA on a mixture-of-experts "
                       "model's experts is not supported"):
        add_lora(Decoder(_config(), rngs=nnx.Rngs(0)), LoraSpec(4, 8.0))
    model = add_lora(Decoder(_config(), rngs=nnx.Rngs(0)), LoraSpec(4, 8.0, ("q_proj", "o_proj")))
    for layer in model.layers:  # a trained-looking adapter (B = 0 at init changes nothing)
        layer.attn.q_lora.lora_b[...] = jnp.full(layer.attn.q_lora.lora_b.shape, 0.05)
    tokens = jnp.asarray(np.random.default_rng(11).integers(0, 64, (1, 6)), jnp.int32)
    adapted = np.asarray(model.logits(model(tokens)))
    save_pretrained(model, tmp_path)  # W + (α/r)·A·B merged into the HF weights
    merged = load_pretrained(tmp_path)
    np.testing.assert_allclose(np.asarray(merged.logits(merged(tokens))), adapted, atol=2e-5)
    plain = Decoder(_config(), rngs=nnx.Rngs(0))
    assert np.abs(np.asarray(plain.logits(plain(tokens))) - adapted).max() > 1e-3


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_random_architecture_builds_each_moe_family(family):
    from jaxrl_llm.config import ModelConfig
    from jaxrl_llm.weights.loading import decoder_config

    section = ModelConfig(family=family, vocab_size=128, hidden_size=32, intermediate_size=64,
                          num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=48 if family == "qwen2_moe" else 0,
                          router_z_loss_coef=0.01)
    config = decoder_config(section)  # source random: the section's own architecture
    assert (config.family, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size) == (family, 4, 2, 16)
    assert config.qk_norm == (family == "qwen3_moe") and config.qkv_bias == (family == "qwen2_moe")
    assert (config.router_aux_loss_coef, config.router_z_loss_coef) == (0.001, 0.01)
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    assert abstract.layers[0].mlp.gate.shape == (4, 32, 16)
    assert hasattr(abstract.layers[0].mlp, "shared_gate") == (family == "qwen2_moe")
