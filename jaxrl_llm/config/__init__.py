"""Typed, validated configuration: YAML files plus `a.b=c` command-line overrides.

Every section is a pydantic model with `extra="forbid"`, so an unknown key or a value of the
wrong type fails at load time with a `ConfigError` that names the dotted key and the file (or
the override) it came from. Each section lives in the module named for its owner (`model.py`
for the opener and weights loader, `loss.py` built from the loss registry, `train.py` for
`optim`/`mesh`/`train`/`metrics`, `data.py`, `generate.py`, `eval.py`, `plan.py`, `env.py`;
`base.py` holds `Section`); this module holds the experiment config that gathers them and the loaders.
The defaults are the papers' (paper sections cited per field).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

# The sections, each in the module of its owner's name; all importable from here.
from jaxrl_llm.config.base import Section
from jaxrl_llm.config.data import DataConfig
from jaxrl_llm.config.env import EnvConfig
from jaxrl_llm.config.eval import EvalConfig
from jaxrl_llm.config.generate import GenerateConfig
from jaxrl_llm.config.io import dump_config, parse_override, read_tree, validate_tree  # noqa: F401 (re-exported)
from jaxrl_llm.config.loss import LossConfig
from jaxrl_llm.config.model import LoraConfig, ModelConfig  # noqa: F401 (re-exported)
from jaxrl_llm.config.plan import PlanConfig
from jaxrl_llm.config.train import MeshConfig, MetricsConfig, OptimConfig, TrainConfig
from jaxrl_llm.core.errors import ConfigError  # noqa: F401 re-exported: defined apart so leaves need no schema
from jaxrl_llm.core.paths import RunPath  # run/output paths: absolute (or gs://) once validated


class ExperimentConfig(Section):
    """One experiment: every section plus the run's identity and seed."""

    name: str = "experiment"  # the experiment's name (run labels, W&B run name)
    # where train writes checkpoints, metrics and config.yaml (local or gs://)
    run_dir: RunPath = Field("runs/experiment", validate_default=True)
    seed: int = 0  # random seed: model init, data order, sampling
    model: ModelConfig = Field(default_factory=ModelConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)

    @model_validator(mode="after")
    def _pack_needs_unpaired_loss(self) -> ExperimentConfig:
        # The one config-level check; the loader and the loss guard their own inputs too.
        if self.data.pack and self.loss.spec.needs_pairs:
            raise ValueError(
                f"data.pack=true cannot train loss.name={self.loss.name}: its pairs index rows "
                "(pair_index), not packed records; set data.pack=false"
            )
        if self.data.pack and self.loss.spec.needs_score_norms:
            raise ValueError(
                f"data.pack=true cannot train loss.name={self.loss.name}: its baseline needs "
                "each record's own gradient norm, one backward pass per row; set data.pack=false"
            )
        return self

    @model_validator(mode="after")
    def _context_parallel_fits(self) -> ExperimentConfig:
        # Refused here, at load time, before any model is built or compiled.
        c = self.mesh.context
        if c == 1:
            return self
        chunks = 2 * c  # parallel/context.py: 2c load-balanced chunks per row
        for key, length in [("train.max_seq_len", self.train.max_seq_len),
                            *(("data.buckets", n) for n in self.data.buckets or ())]:
            if length % chunks:
                raise ValueError(
                    f"mesh.context={c} splits each row into 2 × {c} = {chunks} load-balanced "
                    f"chunks, which do not divide {key}={length}: set {key} to a multiple of "
                    f"{chunks} (e.g. {-(-length // chunks) * chunks}), or change mesh.context")
        if self.model.attention in ("xla", "cudnn"):
            raise ValueError(
                f"model.attention={self.model.attention} cannot run context parallelism "
                f"(mesh.context={c}): it takes no load-balanced causal mask; set "
                "model.attention=auto (splash on TPU, jnp elsewhere), jnp, splash or ring")
        if self.model.routing_replay != "off":
            raise ValueError(
                f"model.routing_replay={self.model.routing_replay} cannot run with mesh.context="
                f"{c}: the replayed experts ride in the natural token order only; set "
                "mesh.context=1 or model.routing_replay=off")
        if self.loss.name in ORDER_DEPENDENT_LOSSES:
            raise ValueError(
                f"loss.name={self.loss.name} cannot train with mesh.context={c}: "
                f"{ORDER_DEPENDENT_LOSSES[self.loss.name]}; set mesh.context=1")
        return self


# Losses whose value depends on the tokens' order in a row (context parallelism permutes it).
ORDER_DEPENDENT_LOSSES = {
    "m2po": "its token-dropping loop breaks ties between equal (log r)² by token position",
}


def config_from_dict(
    tree: Mapping[str, Any],
    overrides: Sequence[str] = (),
    *,
    source: str = "",
    schema: type[Section] = ExperimentConfig,
) -> Any:
    """Validate a config tree (plus overrides) against `schema`, naming bad keys and sources."""
    return validate_tree(tree, overrides, source=source, schema=schema)


def load_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    *,
    schema: type[Section] = ExperimentConfig,
) -> Any:
    """Load a YAML file (or only defaults when `path` is None) and apply `a.b=c` overrides."""
    tree = {} if path is None else read_tree(path)
    return config_from_dict(tree, overrides, source="" if path is None else str(path), schema=schema)
