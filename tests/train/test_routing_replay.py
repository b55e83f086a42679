"""Routing replay (`model.routing_replay: sampler`, docs/moe.md) from the sampler through the
score pass to the train step, on a tiny random Qwen3-MoE in float32.

- The JAX sampler records every completion token's experts in the records and the manifest
  says so (`extra.routing`).
- The score pass replays them: on the sampler's own routing μ equals the un-replayed μ (same
  weights, same numerics: the same experts); on routing changed by hand (every id + 1 mod E)
  μ equals a cache-free decoder forward given those experts at the completion's input
  positions (placed here by hand), and differs from the sampler's.
- The train step replays them too: after a replayed score, log π − log μ is 0 at step 1 on
  either routing, while a train step that routes by itself on the changed records is not.
- Bad input, before any model is loaded: replay on records without routing (JAX records
  sampled without it, records a vLLM backend wrote) or with another model's layer count is
  a `ConfigError` naming `model.routing_replay` and the records directory; replay on a dense
  family or with context parallelism is refused when the config loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, config_from_dict
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.routing import routing_info
from jaxrl_llm.data.shards import RecordSource, SamplingInfo, read_manifest, write_records
from jaxrl_llm.generate.jax_backend import generate_records
from jaxrl_llm.policy.opener import open_model
from jaxrl_llm.tasks import task_from_config
from jaxrl_llm.train.router_disagreement import RouterDisagreement, model_routing
from jaxrl_llm.train.score import score_records
from jaxrl_llm.train.trainer import Trainer
from tests.reliability import record as reliability_record

EXPERTS, K = 8, 2
FP32_BOUND = 1e-5


def experiment(tmp: Path, replay: str = "sampler", **model: object) -> dict:
    return {
        "run_dir": str(tmp / f"run-{replay}"), "seed": 1,
        "model": {"family": "qwen3_moe", "vocab_size": 128, "hidden_size": 32,
                  "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                  "head_dim": 16, "num_experts": EXPERTS, "num_experts_per_tok": K,
                  "moe_intermediate_size": 24, "max_position_embeddings": 256,
                  "param_dtype": "float32", "compute_dtype": "float32",
                  "routing_replay": replay, **model},
        "loss": {"name": "topr"},
        "optim": {"learning_rate": 1e-3},
        "train": {"steps": 1, "batch_size": 8, "max_seq_len": 160, "log_every": 10},
        "generate": {"n": 2, "max_new_tokens": 12, "temperature": 1.0},
        "data": {"task": "arithmetic", "num_prompts": 4,
                 "task_options": {"min_ops": 1, "max_ops": 1}},
    }


@pytest.fixture(scope="module")
def flow(tmp_path_factory) -> dict:
    """Records sampled with routing, the same records with every expert id moved by one, and
    both scored with replay; the model that sampled them."""
    tmp = tmp_path_factory.mktemp("replay")
    config = config_from_dict(experiment(tmp))
    opened = open_model(None, config)
    model, task = opened.model, task_from_config(config)
    g = config.generate
    sampled = tmp / "records"
    generate_records(model, opened.tokenizer, task, task.load(num=config.data.num_prompts),
                     str(sampled), n=g.n, temperature=g.temperature,
                     max_new_tokens=g.max_new_tokens, batch_size=8, seed=0, progress=False,
                     return_routing=True)
    moved = tmp / "moved"
    manifest = read_manifest(sampled)
    write_records(moved, [r.replace(routing=((r.routing + 1) % EXPERTS).astype(np.int8))
                          for r in RecordSource(sampled)],
                  vocab_size=manifest.vocab_size, sampling=manifest.sampling, extra=manifest.extra)
    out = {"tmp": tmp, "model": model, "sampled": sampled, "moved": moved}
    for name in ("sampled", "moved"):
        for replay in (True, False):
            key = f"{name}_scored" + ("" if replay else "_own")
            score_records(model, str(out[name]), str(tmp / key), batch_size=8, progress=False,
                          routing_replay=replay)
            out[key] = tmp / key
    return out


def first_row(flow: dict, records: Path, replay: str) -> dict:
    tree = experiment(flow["tmp"], replay)
    tree["data"]["records"] = str(records)
    trainer = Trainer(config_from_dict(tree), model=flow["model"], progress=False,
                      tensorboard=False)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    return json.loads(result.metrics_path.read_text().splitlines()[0])


def test_the_sampler_records_each_completion_tokens_experts(flow):
    config = flow["model"].config
    assert read_manifest(flow["sampled"]).extra["routing"] == routing_info(config)
    records = list(RecordSource(flow["sampled"]))
    for r in records:
        assert r.routing.shape == (r.completion_ids.size - 1, config.num_layers, K)
        assert r.routing.dtype == np.int8
    # scored records keep them, and say the score pass replayed them
    scored = list(RecordSource(flow["sampled_scored"]))
    for a, b in zip(records, scored, strict=True):
        np.testing.assert_array_equal(a.routing, b.routing)
    assert read_manifest(flow["sampled_scored"]).extra["score_routing_replay"] == "sampler"


def _mu(directory: Path) -> list[np.ndarray]:
    return [r.mu_logprobs for r in RecordSource(directory)]


def test_the_score_pass_replays_the_records_experts(flow):
    model = flow["model"]
    replayed, own = _mu(flow["sampled_scored"]), _mu(flow["sampled_scored_own"])
    for a, b in zip(replayed, own, strict=True):  # the sampler's experts are the model's own
        np.testing.assert_allclose(a, b, atol=1e-6)
    moved = _mu(flow["moved_scored"])
    assert max(np.abs(a - b).max() for a, b in zip(moved, replayed, strict=True)) > 1e-3
    layers, width = model.config.num_layers, 160  # right padding: after every token
    logp_of = jax.jit(lambda tokens, given: jax.nn.log_softmax(
        model.logits(model(tokens, routing=given))[0], axis=-1))
    for r, mu in zip(RecordSource(flow["moved"]), moved, strict=True):
        p, c = r.prompt_ids.size, r.completion_ids.size
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :p + c - 1] = np.concatenate([r.prompt_ids, r.completion_ids[:-1]])
        given = np.full((layers, 1, width, K), -1, np.int32)
        given[:, 0, p:p + c - 1] = r.routing.transpose(1, 0, 2)  # input p + j: token j
        logp = np.asarray(logp_of(jnp.asarray(tokens), jnp.asarray(given)))
        want = logp[np.arange(p - 1, p - 1 + c), r.completion_ids]
        np.testing.assert_allclose(mu, want, atol=2e-6)


def test_router_disagreement_counts_moved_experts_and_no_others(flow):
    """The measuring tool of benchmarks/moe_router_disagreement.py: the model routes the
    sampled records' tokens as the sampler did (float32), and every token moved by one expert
    id disagrees in every layer (a set of k = 2 of 8 ids never maps onto itself)."""
    model = flow["model"]
    sampled, moved = list(RecordSource(flow["sampled"])), list(RecordSource(flow["moved"]))
    own = model_routing(model, [(r.prompt_ids, r.completion_ids) for r in sampled], 160)
    same, shifted = (RouterDisagreement(model.config.num_layers) for _ in range(2))
    for r, m, again in zip(sampled, moved, own, strict=True):
        same.add(r.routing, again)
        shifted.add(m.routing, again)
    tokens = sum(r.completion_ids.size - 1 for r in sampled)
    assert same.to_json() == {"per_layer": [0.0, 0.0], "mean": 0.0, "any_layer": 0.0,
                              "tokens": tokens}
    assert shifted.to_json() == {"per_layer": [1.0, 1.0], "mean": 1.0, "any_layer": 1.0,
                                 "tokens": tokens}


@pytest.mark.slow
def test_the_train_step_replays_them_so_pi_is_mu_at_step_one(flow):
    for records in ("sampled_scored", "moved_scored"):
        row = first_row(flow, flow[records], "sampler")
        assert abs(row["loss/log_ratio_mean"]) < FP32_BOUND, (records, row)
        assert abs(row["loss/log_ratio_max"]) < 10 * FP32_BOUND, (records, row)
    # the changed experts scored with replay, trained without: π is another policy than μ
    row = first_row(flow, flow["moved_scored"], "off")  # measured: max 1.4e-2 (replayed 1.4e-6)
    assert abs(row["loss/log_ratio_max"]) > 1e-3, row


def _refused(tmp: Path, records: Path, **model: object) -> str:
    tree = experiment(tmp, **model)
    tree["data"]["records"] = str(records)
    tree["loss"]["mu_source"] = "sampler"  # not scored: μ is the sampler's
    with pytest.raises(ConfigError) as err:
        Trainer(config_from_dict(tree), progress=False, tensorboard=False)
    return str(err.value)


@pytest.mark.reliability
def test_replay_on_records_without_routing_is_refused_before_loading(tmp_path, flow):
    plain = tmp_path / "plain"
    write_records(plain, [r.replace(routing=None) for r in RecordSource(flow["sampled"])],
                  vocab_size=128, sampling=SamplingInfo(backend="jax", temperature=1.0))
    text = _refused(tmp_path, plain)
    for part in ("model.routing_replay=sampler", str(plain), "extra.routing", "jax backend"):
        assert part in text, text
    vllm = tmp_path / "vllm"
    write_records(vllm, [Record([1, 2], [3, 4], reward=1.0)], vocab_size=128,
                  sampling=SamplingInfo(backend="vllm", temperature=1.0))
    text = _refused(tmp_path, vllm)
    assert "vllm backend, which cannot record them" in text and str(vllm) in text, text
    text = _refused(tmp_path, flow["sampled"], num_layers=3)
    assert "'layers': 2" in text and "'layers': 3" in text and str(flow["sampled"]) in text
    reliability_record(
        "bad input", "routing replay on records without routing (or another model's)", runs=3,
        failures=0, detail="JAX records sampled without it, vLLM-backend records, records of a "
        "2-layer model for a 3-layer one: ConfigError before the model loads, naming "
        "model.routing_replay=sampler, the records directory and extra.routing")


def test_replay_on_a_dense_family_or_with_context_parallelism_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model.routing_replay=sampler replays a mixture of "
                       r"experts' routing, but model.family=llama is dense"):
        config_from_dict({"model": {"family": "llama", "routing_replay": "sampler"}})
    tree = experiment(tmp_path)
    tree["mesh"] = {"context": 2}
    with pytest.raises(ConfigError, match=r"model.routing_replay=sampler cannot run with "
                       r"mesh.context=2"):
        config_from_dict(tree)
