"""Every loss reads only model tokens: an episode's environment tokens (tool results,
feedback, template turn tokens between the model's turns, `Record.action_mask` 0) are never
actions, for every registered loss.

Through the public path the train step calls: multi-turn records → `data.collate.record_row`
/ `collate` (which sets `loss_mask` from the action mask) → `train.loss_fn.compute_loss` with
random hidden states and unembedding (the kernel computes log π from them, so a kernel
bypassing the mask reads the environment tokens' log-probs). For each registry entry:

(a) the gradient of the loss w.r.t. the hidden states at environment tokens (the only way
    they reach the loss is their per-token log-prob and entropy), w.r.t. the batch's μ,
    behaviour and π_ref log-probs there, and w.r.t. the reference model's hidden states
    there, is exactly zero, while the model tokens' is not;
(b) other values there (random, then NaN) leave the loss, its weight and every metric
    exactly unchanged;
(c) the loss equals the loss of the same records with their environment tokens deleted
    (compacted single-turn records, the same hidden states at the model tokens): whatever
    counts tokens (length normalisation, token means, M2PO's second moment) counts model
    tokens only.

And by hand (float64 NumPy from the hidden states): a multi-turn record's TOPR sequence ratio
is exp(Σ over model tokens (log π − log μ)) (TOPR arXiv:2503.14286 eq. 7, its taper eq. 11
transcribed here), GSPO's is that sum over the model-token count (arXiv:2507.18071 eq. 7),
Off-RL's π(y)^{1/|y|} likewise (FPA arXiv:2509.19893 eq. 1), and the token means weigh model
tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.config import config_from_dict
from jaxrl_llm.data.collate import collate, collate_packed, record_row
from jaxrl_llm.data.records import Record, validate_record
from jaxrl_llm.losses.registry import LOSS_NAMES
from jaxrl_llm.train.loss_fn import batch_advantages, compute_loss

VOCAB, D, T, K = 40, 16, 24, 3
# Per record: prompt length and the completion's turns (1 = model, 0 = environment).
EPISODES = [
    (3, [(1, 3), (0, 2), (1, 2)]),
    (2, [(1, 2), (0, 3), (1, 1), (0, 1), (1, 2)]),
    (4, [(1, 4)]),  # a single-turn record in the same batch
    (2, [(1, 1), (0, 4), (1, 3)]),
    (3, [(1, 2), (0, 1), (1, 2), (0, 2)]),  # ends on an environment turn (truncated episode)
    (2, [(1, 3), (0, 2), (1, 3)]),
    (5, [(1, 2), (0, 3), (1, 1)]),
    (2, [(1, 5), (0, 1), (1, 1)]),
]
REWARDS = [1.0, -1.0, 0.5, -0.5, 2.0, -1.5, 1.0, -1.0]  # two groups of 4, both signs in each


def episode_records(seed: int = 0) -> list[Record]:
    """The EPISODES as records with sampler/μ/π_ref log-probs at model tokens, 0.0 elsewhere."""
    rng = np.random.default_rng(seed)
    out = []
    for i, ((p, turns), reward) in enumerate(zip(EPISODES, REWARDS, strict=True)):
        action = np.concatenate([np.full(n, kind, np.uint8) for kind, n in turns])
        c = action.size
        behavior, mu, ref = (np.where(action == 1, -rng.uniform(2.5, 5.0, c), 0.0)
                             for _ in range(3))
        record = Record(
            prompt_ids=rng.integers(1, VOCAB, p), completion_ids=rng.integers(1, VOCAB, c),
            reward=reward, correct=reward > 0, group_id=i // 4, task="unit",
            behavior_logprobs=behavior, mu_logprobs=mu, ref_logprobs=ref, action_mask=action,
        )
        validate_record(record, where=f"episode {i}", vocab_size=VOCAB)
        out.append(record)
    return out


def compacted(record: Record) -> Record:
    """The record with its environment tokens deleted: a single-turn record of its model tokens."""
    keep = record.action_mask == 1
    return record.replace(
        completion_ids=record.completion_ids[keep], action_mask=None,
        **{name: getattr(record, name)[keep]
           for name in ("behavior_logprobs", "mu_logprobs", "ref_logprobs")})


def make_config(name: str, **loss_options):
    needs_model = name == "fpa" or loss_options.get("kl_exact", False)
    return config_from_dict({
        "seed": 0,
        "model": {"vocab_size": VOCAB},
        "loss": {"name": name, "logprob_chunk_size": 16, **loss_options},
        "generate": {"temperature": 1.0},
        "train": {"batch_size": len(EPISODES), "max_seq_len": T,
                  "ref_logprobs": "model" if needs_model else "batch"},
    })


def positions(records: list[Record]) -> tuple[np.ndarray, np.ndarray]:
    """bool [B, T] (environment targets, model targets) of the unpacked batch."""
    env, model = np.zeros((len(records), T), bool), np.zeros((len(records), T), bool)
    for i, r in enumerate(records):
        start = r.prompt_ids.size - 1
        mask = r.model_tokens()
        env[i, start:start + mask.size] = ~mask
        model[i, start:start + mask.size] = mask
    return env, model


def source_positions(record: Record) -> np.ndarray:
    """Row positions of the multi-turn row that the compacted record's row positions hold:
    the prompt's inputs, then the model tokens' targets in order."""
    start = record.prompt_ids.size - 1
    return np.concatenate([np.arange(start), start + np.flatnonzero(record.action_mask == 1)])


def random_inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"hidden": rng.normal(0, 1, (len(EPISODES), T, D)).astype(np.float32),
            "ref_hidden": rng.normal(0, 1, (len(EPISODES), T, D)).astype(np.float32),
            "unembed": rng.normal(0, 0.6, (D, VOCAB)).astype(np.float32),
            "ref_unembed": rng.normal(0, 0.6, (D, VOCAB)).astype(np.float32)}


def loss_and_grads(config):
    """jit((batch, hidden, ref_hidden, unembed, ref_unembed) → ((loss, total, weight, metrics),
    grads w.r.t. hidden, μ, behaviour, π_ref log-probs and ref_hidden))."""

    def run(batch, hidden, ref_hidden, unembed, ref_unembed):
        advantages = batch_advantages(config, batch)  # as the step: on the whole batch

        def f(hidden, mu, behavior, ref, ref_hidden):
            b = batch.replace(mu_logprobs=mu, behavior_logprobs=behavior, ref_logprobs=ref)
            out = compute_loss(config, b, hidden, unembed, ref_hidden=ref_hidden,
                               ref_unembed=ref_unembed, advantages=advantages)
            return out.loss, (out.total, out.weight, out.metrics)

        (loss, aux), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True)(
            hidden, batch.mu_logprobs, batch.behavior_logprobs, batch.ref_logprobs, ref_hidden)
        return (loss, *aux), grads

    return jax.jit(run)


# Options a loss needs to be non-trivial here through `compute_loss` alone: TRM's δ = 0.05
# rejects every record of these random log-probs (k2 up to ~10), and VCPO's OPOB baseline
# needs the train step's per-record gradient pre-pass (train/score_norms.py), which a call
# without the model cannot run (tests/losses/test_async_losses_step.py covers it).
DEFAULT_OPTIONS = {"trm": {"trm_delta": 100.0}, "vcpo": {"vcpo_baseline": "group_mean"}}

# Every registry entry (a new one is covered as it is registered), and the options that change
# what a kernel sums over.
CASES = [
    *[pytest.param(name, DEFAULT_OPTIONS.get(name, {}), id=name) for name in LOSS_NAMES],
    pytest.param("trm", {"trm_delta": 3.0}, id="trm-masks-some"),
    pytest.param("topr", {"ratio_level": "token"}, id="topr-token"),
    pytest.param("topr", {"ratio_level": "geometric"}, id="topr-geometric"),
    pytest.param("topr", {"aggregation": "token-mean"}, id="topr-token-mean"),
    pytest.param("tis", {"aggregation": "seq-mean-token-sum-norm"}, id="tis-sum-norm"),
    pytest.param("ppo", {"ratio_level": "token", "aggregation": "seq-mean-token-mean"},
                 id="ppo-token"),
    pytest.param("grpo", {"aggregation": "seq-mean-token-mean"}, id="grpo-seq-mean"),
    pytest.param("icepop", {"icepop_level": "sequence",
                            "icepop_aggregation": "seq-mean-token-mean"}, id="icepop-sequence"),
    pytest.param("m2po", {"m2po_mask": "all_tokens"}, id="m2po-all-tokens"),
    pytest.param("off_rl_kl", {"kl_exact": True}, id="off_rl_kl-exact"),
    pytest.param("fpa", {"fpa_on": "negatives"}, id="fpa-negatives"),
]


def _batch_for(name: str, records: list[Record]):
    pairs = name in ("dpo", "rpo")  # rows (2i, 2i+1) are (chosen, rejected)
    return collate([record_row(r) for r in records], len(records), (T,), pairs=pairs)


def _assert_same(got, want, *, exact: bool) -> None:
    (loss_g, total_g, weight_g, metrics_g), (loss_w, total_w, weight_w, metrics_w) = got, want
    check = (np.testing.assert_array_equal if exact else
             lambda a, b, err_msg="": np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6,
                                                                  err_msg=err_msg))
    check(float(weight_g), float(weight_w), err_msg="weight")
    check(float(total_g), float(total_w), err_msg="total")
    check(float(loss_g), float(loss_w), err_msg="loss")
    assert set(metrics_g) == set(metrics_w)
    for key in metrics_w:
        check(np.asarray(metrics_g[key]), np.asarray(metrics_w[key]), err_msg=key)


@pytest.mark.parametrize(("name", "options"), CASES)
def test_environment_tokens_are_never_actions(name, options):
    config = make_config(name, **options)
    records = episode_records()
    batch = _batch_for(name, records)
    env, model = positions(records)
    # the collate put the action mask into loss_mask: model targets 1, environment targets 0
    np.testing.assert_array_equal(batch.loss_mask > 0, model)
    x = random_inputs(1)
    run = loss_and_grads(config)
    out, grads = run(batch, x["hidden"], x["ref_hidden"], x["unembed"], x["ref_unembed"])
    assert np.isfinite(float(out[0]))

    # (a) zero gradient at environment tokens; not at model tokens
    g_hidden, g_mu, g_behavior, g_ref, g_ref_hidden = (np.asarray(g) for g in grads)
    np.testing.assert_array_equal(g_hidden[env], 0.0)
    assert np.abs(g_hidden[model]).max() > 1e-6  # the loss trains the model tokens
    for what, g in (("mu", g_mu), ("behavior", g_behavior), ("ref", g_ref)):
        np.testing.assert_array_equal(g[env], 0.0, err_msg=what)
    np.testing.assert_array_equal(g_ref_hidden[env], 0.0)
    spec = config.loss.spec
    if spec.needs_ref and config.train.ref_logprobs == "batch":
        assert np.abs(g_ref[model]).max() > 1e-6  # the kernel does read π_ref at model tokens

    # (b) other values at environment tokens: the same loss, weight and metrics, bit for bit
    rng = np.random.default_rng(2)

    def at_env(array: np.ndarray, draw, fill: str) -> np.ndarray:
        new = np.array(array)
        new[env] = np.nan if fill == "nan" else draw(new[env].shape)
        return new

    for fill in ("random", "nan"):
        changed = batch.replace(**{
            key: at_env(getattr(batch, key), lambda s: -rng.uniform(0.0, 9.0, s), fill)
            for key in ("mu_logprobs", "behavior_logprobs", "ref_logprobs")})
        hidden = at_env(x["hidden"], lambda s: rng.normal(0, 3, s), fill)
        ref_hidden = at_env(x["ref_hidden"], lambda s: rng.normal(0, 3, s), fill)
        again, _ = run(changed, hidden, ref_hidden, x["unembed"], x["ref_unembed"])
        _assert_same(again, out, exact=True)

    # (c) the same records with the environment tokens deleted give the same loss
    short = [compacted(r) for r in records]
    compact = _batch_for(name, short)
    src = [source_positions(r) for r in records]

    def gather(array: np.ndarray) -> np.ndarray:
        new = np.zeros_like(array)
        for i, s in enumerate(src):
            new[i, :s.size] = array[i, s]
        return new

    np.testing.assert_array_equal(gather(np.asarray(batch.targets)), compact.targets)
    single, _ = run(compact, gather(x["hidden"]), gather(x["ref_hidden"]), x["unembed"],
                    x["ref_unembed"])
    _assert_same(single, out, exact=False)


# -- by hand ----------------------------------------------------------------------------------


def hand_logprobs(records: list[Record], hidden: np.ndarray, unembed: np.ndarray) -> list[np.ndarray]:
    """log π of each completion token from the hidden states (float64 log-softmax, T = 1)."""
    out = []
    for i, r in enumerate(records):
        start = r.prompt_ids.size - 1
        z = hidden[i, start:start + r.completion_ids.size].astype(np.float64) @ unembed
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        out.append(logp[np.arange(r.completion_ids.size), r.completion_ids])
    return out


def taper(x: float, a: float, b: float) -> float:
    """TOPR eq. 11: a(1 + log(x/a)) below a, x on [a, b], b(1 + log(x/b)) above b."""
    if a > 0 and x < a:
        return a * (1 + np.log(x / a))
    if x > b:
        return b * (1 + np.log(x / b))
    return x


def test_multi_turn_ratios_and_token_counts_by_hand():
    records = episode_records()
    x = random_inputs(3)
    logp = hand_logprobs(records, x["hidden"], x["unembed"].astype(np.float64))
    model = [r.action_mask == 1 for r in records]
    # ℓ = Σ over model tokens of (log π − log μ): the sequence log-ratio of each episode
    ell = np.asarray([(lp[m] - r.mu_logprobs[m].astype(np.float64)).sum()
                      for lp, m, r in zip(logp, model, records, strict=True)])
    n_model = np.asarray([m.sum() for m in model], np.float64)
    rewards = np.asarray(REWARDS, np.float64)
    batch = _batch_for("topr", records)

    def outputs(name: str, **options):
        """(loss, total, weight, metrics) through compute_loss (values only: no backward)."""
        config = make_config(name, **options)
        out = jax.jit(lambda b, h, u: compute_loss(config, b, h, u))(batch, x["hidden"],
                                                                     x["unembed"])
        return out.loss, out.total, out.weight, {k: np.asarray(v) for k, v in out.metrics.items()}

    # TOPR, sequence ratio r = exp(ℓ): per record −A·ρ(r)/|y|, A = R, a/b = 1/1 for A ≥ 0 and
    # 0/1 for A < 0 (TOPR Table 1), |y| = model tokens (seq-mean-token-mean)
    ratio = np.exp(ell)
    per_record = [-a * taper(r, *((1.0, 1.0) if a >= 0 else (0.0, 1.0))) / n
                  for a, r, n in zip(rewards, ratio, n_model, strict=True)]
    loss, total, weight, metrics = outputs("topr")
    np.testing.assert_allclose(float(metrics["log_ratio_mean"]), ell.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["log_ratio_max"]), ell.max(), rtol=1e-5)
    np.testing.assert_allclose(float(total), sum(per_record), rtol=1e-5)
    assert float(weight) == len(records)
    # ... the same with token-level ratios and a token mean: the weight is the model tokens
    _, _, weight, _ = outputs("topr", aggregation="token-mean")
    assert float(weight) == n_model.sum()

    # GSPO: log s = ℓ / |y| with |y| the model tokens (arXiv:2507.18071 eq. 7)
    _, _, weight, metrics = outputs("gspo")
    np.testing.assert_allclose(float(metrics["seq_log_ratio_mean"]), (ell / n_model).mean(),
                               rtol=1e-5)
    assert float(weight) == len(records)
    # token means over the model tokens (CISPO eq. 4's 1/Σ|o_i|, M2PO's 1/Σ|o_i|; the other
    # token means equal their compacted batch's in test_environment_tokens_are_never_actions)
    for name in ("cispo", "m2po"):
        assert float(outputs(name)[2]) == n_model.sum(), name

    # Off-RL: −R·exp(Σ_model log π / |y|) per record (FPA eq. 1)
    seq_logp = np.asarray([lp[m].sum() for lp, m in zip(logp, model, strict=True)])
    _, total, weight, _ = outputs("off_rl")
    np.testing.assert_allclose(float(total), np.sum(-rewards * np.exp(seq_logp / n_model)),
                               rtol=1e-5)


@pytest.mark.parametrize("name", ["topr", "grpo", "fpa"])
def test_packed_episodes_equal_unpacked(name):
    """`collate_packed` keeps each record's action mask: packed rows give the unpacked loss."""
    config = make_config(name)
    records = episode_records()
    rows = [record_row(r) for r in records]
    layout = [[0, 2, 7], [1, 3], [4, 5], [6]]  # ≤ 3 records and ≤ T tokens a row
    packed = collate_packed([[rows[i] for i in row] for row in layout], len(layout), T, K)
    unpacked = _batch_for(name, records)
    x = random_inputs(4)
    run = loss_and_grads(config)
    want, _ = run(unpacked, x["hidden"], x["ref_hidden"], x["unembed"], x["ref_unembed"])
    # hidden states of the packed rows: each record's row positions, back to back
    hidden = np.zeros((len(layout), T, D), np.float32)
    ref_hidden = np.zeros_like(hidden)
    for i, row in enumerate(layout):
        at = 0
        for r in row:
            n = rows[r]["inputs"].size
            hidden[i, at:at + n] = x["hidden"][r, :n]
            ref_hidden[i, at:at + n] = x["ref_hidden"][r, :n]
            np.testing.assert_array_equal(packed.loss_mask[i, at:at + n], unpacked.loss_mask[r, :n])
            at += n
    got, _ = run(packed, jnp.asarray(hidden), jnp.asarray(ref_hidden), x["unembed"],
                 x["ref_unembed"])
    _assert_same(got, want, exact=False)
