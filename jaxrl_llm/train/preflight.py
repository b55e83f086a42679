"""Checks the trainer runs on a record directory before building anything: can these records
train this loss as configured?

- Reference log-probs: a loss that reads log π_ref (`LossSpec.needs_ref`) from the records
  (`train.ref_logprobs: batch`) needs records written by `jaxrl-llm score`, which stores
  π_ref at temperature 1 beside μ (manifest `extra.ref_logprobs`). Without them the loss
  would compare log π with 0: refused, naming the directory and both fixes.
- μ is the policy at step 0: a loss with an importance ratio π/μ (`LossSpec.needs_mu`)
  computes π at `generate.temperature`; μ was computed at the records' temperature (the
  score pass's `extra.score_temperature`, or the sampling temperature for
  `loss.mu_source: sampler`). A config that leaves `generate.temperature` unset takes the
  records' value; one that sets a different value is refused.
- Whole groups: a loss with group statistics (`LossSpec.needs_groups`) on records with one
  record per group (manifest `num_groups` = `num_records`) would have nothing to compare each
  record with: refused, naming the directory and generate.n.
- `loss.mu_source: sampler` needs the sampler's processed log-probs to be the policy's: not
  after top-k/top-p truncation, not greedy (a point mass), and present at all.
- `model.routing_replay: sampler` needs records whose sampler recorded each token's experts
  (manifest `extra.routing`, written by the JAX sampler; vLLM records have none) for a model
  with as many layers and experts per token (`check_routing`).
"""

from __future__ import annotations

import json
import math

from etils import epath

from jaxrl_llm.config import ConfigError, ExperimentConfig
from jaxrl_llm.data.records import validate_record
from jaxrl_llm.data.sampler_info import effective_temperature, manifest_sampler_info
from jaxrl_llm.data.shards import MANIFEST_NAME, Manifest, RecordSource, read_manifest
from jaxrl_llm.train.score import REF_TEMPERATURE
from jaxrl_llm.weights.loading import check_fits_context, decoder_config, model_context


def check_records(config: ExperimentConfig, directory: str | epath.PathLike) -> ExperimentConfig:
    """Refuse records that cannot train `config`'s loss (`ConfigError` naming the records,
    the config key and the fix); returns `config`, with `generate.temperature` taken from
    the records' manifest when the loss reads μ and the config leaves it unset."""
    manifest = read_manifest(directory)
    where = str(epath.Path(directory) / MANIFEST_NAME)
    check_routing(config, directory, manifest)
    spec = config.loss.spec
    if spec.needs_groups:
        check_groups(config.loss.name, manifest, str(directory), where)
    if spec.needs_ref and config.train.ref_logprobs == "batch":
        check_ref_logprobs(config.loss.name, manifest, str(directory), where)
    if not spec.needs_mu:
        return config
    if config.loss.mu_source == "sampler":
        check_sampler_mu(manifest, where)
    return adopt_temperature(config, manifest, str(directory), where)


def check_routing(config: ExperimentConfig, directory: str | epath.PathLike,
                  manifest: Manifest | None = None) -> None:
    """`model.routing_replay: sampler` on records that carry routing for this model (manifest
    `extra.routing`, `data.routing.routing_info`): a `ConfigError` naming the key and the
    directory otherwise, before any model is loaded (config.json is read for the layers)."""
    if config.model.routing_replay == "off":
        return
    manifest = manifest or read_manifest(directory)
    where = str(epath.Path(directory) / MANIFEST_NAME)
    info = manifest.extra.get("routing")
    if not isinstance(info, dict):
        backend = manifest.sampling.backend
        raise ConfigError(
            f"model.routing_replay={config.model.routing_replay} replays the experts each token "
            f"was sampled with, but the records in {directory} carry none ({where} has no "
            f"extra.routing; sampled by the {backend} backend"
            + (", which cannot record them" if backend == "vllm" else "")
            + "): regenerate them with `jaxrl-llm generate` (generate.backend=jax) and "
            "model.routing_replay=sampler, or set model.routing_replay=off")
    model = decoder_config(config.model)
    want = {"layers": model.num_layers, "experts_per_token": model.num_experts_per_tok}
    got = {k: info.get(k) for k in want}
    if got != want:
        raise ConfigError(
            f"model.routing_replay={config.model.routing_replay}: the records in {directory} "
            f"hold the routing of a model with {got} ({where}: extra.routing), this model has "
            f"{want}: replay records sampled by this model, or set model.routing_replay=off")


def check_groups(loss: str, manifest: Manifest, directory: str, where: str) -> None:
    """A loss with group statistics needs groups of ≥ 2 records: with one record per group
    its baseline is the record's own reward (every advantage 0, or for AsymRE −δV alike)."""
    n, groups = manifest.num_records, manifest.num_groups
    if n and groups >= n:
        raise ConfigError(
            f"loss.name={loss} computes its baseline over each prompt's group of samples, but "
            f"{directory} holds {n} records in {groups} groups, one record each ({where}: "
            "num_records, num_groups): generate several samples per prompt (generate.n ≥ 2) "
            "and keep them under one group_id, or pick a loss without groups (e.g. topr)")


def check_ref_logprobs(loss: str, manifest: Manifest, directory: str, where: str) -> None:
    """The records carry π_ref log-probs at temperature 1 (written by `jaxrl-llm score`)."""
    ref = manifest.extra.get("ref_logprobs")
    fix = (f"run `jaxrl-llm score --records {directory}` (it writes ref_logprobs, π_ref at "
           "T=1, beside mu_logprobs) and train on its output, or set train.ref_logprobs=model "
           "(the frozen reference policy runs in the train step)")
    if not isinstance(ref, dict):
        raise ConfigError(
            f"loss.name={loss} reads reference log-probs from the records "
            f"(train.ref_logprobs=batch), but {directory} has none ({where} has no "
            f"extra.ref_logprobs; training would use log π_ref = 0): {fix}")
    if not math.isclose(float(ref.get("temperature", math.nan)), REF_TEMPERATURE):
        raise ConfigError(
            f"loss.name={loss}: {directory} holds ref_logprobs at temperature "
            f"{ref.get('temperature')} ({where}: extra.ref_logprobs.temperature), not "
            f"{REF_TEMPERATURE}: {fix}")


def check_sampler_mu(manifest: Manifest, where: str) -> None:
    """`loss.mu_source: sampler` only on records whose processed log-probs are the policy's."""
    s = manifest.sampling
    info = manifest_sampler_info(manifest)
    fix = ("set loss.mu_source=trainer and train on the output of `jaxrl-llm score` (μ "
           "recomputed from the policy)")
    if info["sampling_truncated"]:
        raise ConfigError(
            f"loss.mu_source=sampler: the records were sampled with top_k={s.top_k}, "
            f"top_p={s.top_p} ({where}: sampling), so their behaviour log-probs are those of "
            f"the truncated distribution, not the policy's: {fix}, or regenerate with "
            "generate.top_k=0 generate.top_p=1")
    if s.temperature <= 0:
        raise ConfigError(
            f"loss.mu_source=sampler: the records were sampled greedily (temperature "
            f"{s.temperature}, {where}), so their behaviour log-probs are 0, not the policy's: {fix}")
    if manifest.extra.get("vllm_logprobs_mode") == "raw_logprobs":
        raise ConfigError(
            f"loss.mu_source=sampler: the records hold vLLM raw log-probs (before temperature; "
            f"{where}: extra.vllm_logprobs_mode) and no behaviour log-probs: {fix}, or "
            "regenerate with generate.vllm_logprobs_mode=processed_logprobs")


def records_temperature(config: ExperimentConfig, manifest: Manifest) -> tuple[float, str]:
    """(temperature μ was computed at, the manifest key that says so)."""
    if config.loss.mu_source == "sampler":
        return effective_temperature(manifest.sampling.temperature), "sampling.temperature"
    t = manifest.extra.get("score_temperature")
    if t is None:  # records given μ by other means (the loader checks they have it): as sampled
        return effective_temperature(manifest.sampling.temperature), "sampling.temperature"
    return float(t), "extra.score_temperature"


def adopt_temperature(config: ExperimentConfig, manifest: Manifest, directory: str,
                      where: str) -> ExperimentConfig:
    """`config` whose `generate.temperature` is the one μ was computed at (see module doc)."""
    records_t, key = records_temperature(config, manifest)
    g = config.generate
    if "temperature" not in g.model_fields_set:
        return config.model_copy(update={"generate": g.model_copy(update={"temperature": records_t})})
    if not math.isclose(effective_temperature(g.temperature), records_t, rel_tol=1e-6):
        raise ConfigError(
            f"generate.temperature={g.temperature} but μ of the records in {directory} is at "
            f"temperature {records_t} ({where}: {key}): π would be computed at another "
            f"temperature than μ, so π/μ ≠ 1 at step 0. Set generate.temperature={records_t} "
            "(or leave it unset to take the records' value)")
    return config



def first_step_metrics(scalars: dict[str, float]) -> dict[str, float]:
    """The step-1 log-ratios (log π − log μ, log π − log π_ref) under "step1/…", so the first
    logged row shows them whatever `train.log_every` is: there the policy is μ and π_ref, so
    each must be ≈ 0 (far from 0: the records' μ or reference is not this model's)."""
    return {f"step1/{k}": v for k, v in scalars.items()
            if k.startswith("loss/") and ("log_ratio" in k or "logratio" in k)}


def model_vocab_size(config: ExperimentConfig) -> int | None:
    """The vocabulary the trainer's model will have, when known without loading it."""
    m = config.model
    if m.source == "random":
        return m.vocab_size
    if m.source == "hf" and m.path and (epath.Path(m.path) / "config.json").exists():
        return json.loads((epath.Path(m.path) / "config.json").read_text()).get("vocab_size")
    return None


def check_all_records(directory: str | epath.PathLike, vocab_size: int | None,
                      chunk: int = 1024, *, process_index: int = 0, process_count: int = 1) -> None:
    """Decode and validate every record once before step 1: a NaN, a positive log-prob, a
    length mismatch or an out-of-vocabulary id anywhere in the set is a `RecordError` naming
    the shard and index before anything trains (the loader only reads a record when its
    batch comes up, possibly hours in). On several hosts each validates every
    `process_count`-th record, so the pass costs 1/P of the data per host."""
    source = RecordSource(directory)
    mine = range(process_index, len(source), process_count)
    for start in range(0, len(mine), chunk):
        indices = list(mine[start:start + chunk])
        for i, record in zip(indices, source.__getitems__(indices)):  # validated vs the manifest
            if vocab_size is not None:
                validate_record(record, where=f"{source.where(i)} (model vocabulary)",
                                vocab_size=vocab_size)


def check_rows_fit_model(config: ExperimentConfig, model: object | None = None) -> None:
    """`train.max_seq_len` within the model's context (max_position_embeddings after
    `model.rope_scaling`): RoPE past it is a position the model never saw. `model`: the policy
    when one is given (else `config.model`'s, read without weights)."""
    given = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    context = model_context(config.model) if model is None else (
        None if given is None else (given, "the given model's config"))
    t = config.train.max_seq_len
    check_fits_context(context, t, what=f"train.max_seq_len={t}", fix="lower train.max_seq_len",
                       random=model is None and config.model.source == "random")


def check_records_fit_model(config: ExperimentConfig, directory: str | epath.PathLike) -> None:
    """Every record's row (prompt + completion − 1 input tokens) within `config.model`'s
    context, from the shards' length files (no record decoded, no weights read)."""
    source = RecordSource(directory)
    if not len(source):
        return
    rows = source.lengths().sum(axis=1) - 1
    i = int(rows.argmax())
    check_fits_context(model_context(config.model), int(rows[i]),
                       what=f"record {source.where(i)} (a row of {int(rows[i])} tokens, the "
                       "longest)", fix="score with the model and model.rope_scaling that "
                       "sampled these records", random=config.model.source == "random")


def check_batch_divides(config: ExperimentConfig, mesh: object) -> None:
    """`train.batch_size` (and `micro_batch_size`) must split evenly over the mesh's data×fsdp
    devices: refused here, naming the keys, not at the first step's device transfer."""
    shape = dict(getattr(mesh, "shape", {}))
    shards = shape.get("data", 1) * shape.get("fsdp", 1)
    for key in ("batch_size", "micro_batch_size"):
        value = getattr(config.train, key)
        if value is not None and value % shards:
            raise ConfigError(f"train.{key}={value} is not a multiple of the mesh's data×fsdp = "
                              f"{shards} devices; choose a multiple of {shards}")

