"""The `online:` section of `jaxrl-llm online` (docs/online.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from jaxrl_llm.config import ExperimentConfig, Section
from jaxrl_llm.core.paths import RunPath


class OnlineSection(Section):
    """The online loop: each round samples `prompts_per_round` prompts × `generate.n`
    completions with the current policy, rewards and transforms them, queues them as
    `updates_per_round` batches of `train.batch_size` records, and trains on the batches that
    leave the queue."""

    rounds: int = Field(10, gt=0, description="rounds that train (each `updates_per_round` "
                        "optimizer updates); `staleness` adds the rounds that fill the queue")
    prompts_per_round: int = Field(8, gt=0, description="prompts sampled per round (their "
                                   "`generate.n` completions are one group each)")
    updates_per_round: int = Field(1, gt=0, description="optimizer updates per round: the "
                                   "round's records split into this many batches")
    staleness: int = Field(0, ge=0, description="each update trains on a batch sampled this many "
                           "updates earlier (a FIFO queue of this many batches); 0 = on-policy")
    mu_source: Literal["auto", "sampler", "trainer"] = Field(
        "auto", description="μ of losses that read it: the sampler's log-probs (sampler), a "
        "re-score with the trainer's numerics right after sampling (trainer), or sampler when the "
        "first round's sampler and trainer log-probs agree within max_mu_mismatch and sampling "
        "is untruncated (auto)")
    max_mu_mismatch: float = Field(1e-4, gt=0, description="auto: the largest per-token "
                                   "|sampler − trainer| log-prob difference that keeps the "
                                   "sampler's log-probs as μ")
    pkpo_k: list[int] | None = Field(None, description="PKPO's k per round (the last value "
                                     "repeats; e.g. [8, 8, 4, 1] anneals); None = data.pkpo_k")
    pass_k: list[int] = Field(default_factory=lambda: [1], description="k of the per-round "
                              "pass@k metrics (each ≤ generate.n; generate.n is always logged)")
    pipeline: Literal["off", "deterministic", "free"] = Field(
        "off", description="off: sample then train, in turn. deterministic: the sampler runs "
        "ahead on its own devices (online.sampler_devices) while the trainer trains, the same "
        "computation as off (update u trains on θ_{u−staleness}'s batch); needs staleness ≥ 1. "
        "free: the sampler always uses the newest weights and the trainer drops batches more "
        "than online.max_staleness updates old (not reproducible) (docs/online.md § Pipeline)")
    max_staleness: int = Field(4, ge=0, description="pipeline: free: the largest version lag "
                               "(updates since the weights that sampled a batch) the trainer "
                               "trains on; older batches are dropped and counted")
    inflight_weights: bool = Field(
        False, description="pipeline: free: the sampler also takes newer published weights "
        "between decode segments of a round's generation (PipelineRL's in-flight updates, "
        "arXiv:2509.19128): a long sample's later tokens come from newer weights, each record "
        "names the version of each token (metadata weight_versions), μ is the sampler's "
        "log-probs (needs mu_source: sampler) and a batch's lag counts from its oldest token")
    sampler_devices: int = Field(0, ge=0, description="devices (the first N of this host's) "
                                 "the sampler runs on, the rest train (mesh: over the rest); "
                                 "0 = the sampler shares the trainer's devices. Weights move "
                                 "between them in memory")
    checkpoint_every: int = Field(1, gt=0, description="rounds between checkpoints (params, "
                                  "optimizer, RNG, queued samples, prompt position)")
    exchange: RunPath | None = Field(
        None, description="a directory (local or gs://) the trainer and rollout-worker "
        "processes share and nothing else: the trainer publishes weight versions there, the "
        "workers record shards; when set, `jaxrl-llm online` runs one side and needs --role "
        "trainer or --role worker --worker K (docs/online.md § Pipeline)")
    workers: int = Field(1, gt=0, description="exchange: rollout worker processes; worker K "
                         "samples the rounds r with r % workers == K")
    worker_timeout_s: float = Field(600.0, gt=0, description="exchange: seconds a side waits "
                                    "for the other (a round, a weight version) before failing "
                                    "with an error naming the exchange path")

    @model_validator(mode="after")
    def _positive_k(self) -> OnlineSection:
        for name in ("pkpo_k", "pass_k"):
            values = getattr(self, name) or []
            if any(k < 1 for k in values):
                raise ValueError(f"online.{name}: every k must be >= 1 (got {values})")
        return self


class OnlineConfig(ExperimentConfig):
    """An experiment plus the `online:` section."""

    online: OnlineSection = Field(default_factory=OnlineSection)
