"""Which record directory each stage of the chain reads and writes, from ONE config.

    generate ──▶ generate.output, default data.records
    score    ◀── data.records
             ──▶ generate.score_output            (default: `<data.records>-scored`)
    curate   ◀── the scored records when they exist, else data.records
             ──▶ data.curated
    train    ◀── data.curated when set (it must hold records: run `jaxrl-llm curate` first),
                 else the scored records when they exist, else data.records

An explicit `--records` (or the API's `records=`) always wins. `iterate` applies the same rule
to its per-iteration directories through `choose_input`. `check_mu` refuses, before anything
is built, records without μ for a loss that reads μ (`LossSpec.needs_mu`).
"""

from __future__ import annotations

from typing import Any

from etils import epath

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.data.shards import MANIFEST_NAME, RecordSource, read_manifest

STAGES = ("score", "curate", "train")


def holds_records(directory: str | epath.PathLike | None) -> bool:
    """True when `directory` is a record directory (has a manifest)."""
    return directory is not None and (epath.Path(directory) / MANIFEST_NAME).exists()


def scored_directory(config: Any, records: str | None = None) -> str | None:
    """Where `score` writes: generate.score_output, else `<records>-scored` (records default
    data.records); None when neither is known."""
    records = records if records is not None else config.data.records
    if config.generate.score_output is not None:
        return str(config.generate.score_output)
    return None if records is None else str(records).rstrip("/") + "-scored"


def choose_input(stage: str, *, records: str | None, scored: str | None,
                 curated: str | None = None) -> str:
    """The rule of the module docstring on explicit directories (`iterate` passes its own).

    Raises `ConfigError` naming the key to set when the stage has nothing to read.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    if stage == "train" and curated is not None:
        if not holds_records(curated):
            raise ConfigError(
                f"data.curated={curated} holds no records (no {MANIFEST_NAME}): run "
                "`jaxrl-llm curate` with this config first, or unset data.curated to train on "
                "the scored (or generated) records")
        return str(curated)
    if stage != "score" and holds_records(scored):
        return str(scored)
    if records is None:
        raise ConfigError(f"{stage}: no records to read: set data.records (the generate "
                          "stage's output) or pass --records")
    return str(records)


def stage_input(config: Any, stage: str, override: str | epath.PathLike | None = None) -> str:
    """The record directory `stage` ("score", "curate" or "train") reads under `config`;
    `override` (a `--records` flag) wins. See the module docstring."""
    if override is not None:
        return str(override)
    d = config.data
    return choose_input(stage, records=d.records, scored=scored_directory(config),
                        curated=d.curated if stage == "train" else None)


def stage_output(config: Any, stage: str, override: str | epath.PathLike | None = None) -> str:
    """The directory `stage` ("generate", "score" or "curate") writes; `override` (`--out`)
    wins."""
    if override is not None:
        return str(override)
    if stage == "generate":
        out = config.generate.output or config.data.records
        if out is None:
            raise ConfigError("generate writes nowhere: set data.records (where score, curate "
                              "and train look for its records) or generate.output, or pass --out")
        return str(out)
    if stage == "score":
        out = scored_directory(config)
        if out is None:
            raise ConfigError("score: set data.records (its input) or generate.score_output")
        return out
    if stage == "curate":
        if config.data.curated is None:
            raise ConfigError("curate writes nowhere: set data.curated (or pass --out)")
        return str(config.data.curated)
    raise ValueError(f"stage {stage!r} writes no record directory; expected generate, score "
                     "or curate")


def needs_score(config: Any) -> bool:
    """True when the loss reads what `score` writes: μ (`needs_mu`, loss.mu_source=trainer) or
    π_ref from the records (`needs_ref`, train.ref_logprobs=batch)."""
    spec = config.loss.spec
    return ((spec.needs_mu and config.loss.mu_source == "trainer")
            or (spec.needs_ref and config.train.ref_logprobs == "batch"))


def has_mu(directory: str | epath.PathLike) -> bool:
    """Whether the records of `directory` carry μ: the manifest's `scored_by` (set by the
    score pass and kept by curate), else the first record's `mu_logprobs`."""
    if read_manifest(directory).scored_by is not None:
        return True
    source = RecordSource(directory)
    return len(source) == 0 or source[0].mu_logprobs is not None


def check_mu(config: Any, directory: str | epath.PathLike) -> None:
    """Refuse, before training starts, records without μ for a loss that reads μ."""
    if not (config.loss.spec.needs_mu and config.loss.mu_source == "trainer"):
        return
    if not has_mu(directory):
        raise ConfigError(
            f"loss.name={config.loss.name} weights records by π/μ, but {directory} has no "
            f"mu_logprobs (its {MANIFEST_NAME} has no scored_by): run `jaxrl-llm score` on "
            "these records and train on its output (with one config: generate → score → "
            "curate → train), or set loss.mu_source=sampler")
