"""The `eval:` section (eval/: evaluation during and after training)."""

from __future__ import annotations

from pydantic import (
    Field,
)

from jaxrl_llm.config.base import Section
from jaxrl_llm.core.paths import RunPath  # run/output paths: absolute (or gs://) once validated


class EvalConfig(Section):
    """Evaluation (eval/, TOPR §4.2, FPA App. B.3)."""

    n: int = Field(8, gt=0)  # samples per question
    num_questions: int = Field(100, gt=0)  # questions evaluated
    maj_k: list[int] = Field(default_factory=lambda: [1, 4])  # K values of maj@K
    bootstrap_trials: int = Field(100, gt=0)  # bootstrap resamples of maj@K's error bar
    split: str = "test"  # task split evaluated
    task_path: RunPath | None = Field(
        None, description="the evaluation questions' file (default: data.task_path; a local "
        "file holds one split; made absolute against the current directory)")
    # Sampling for evaluation; None = the generate section's value (FPA arXiv:2509.19893 evaluates at T=0.7).
    temperature: float | None = Field(None, ge=0)
    # longest completion; null = generate.max_new_tokens
    max_new_tokens: int | None = Field(None, gt=0)
    # prompts per sampler batch; null = generate.batch_size
    batch_size: int | None = Field(None, gt=0)
    seed: int = 1234  # sampling seed
    # per solution, for weighted self-consistency (TOPR arXiv:2503.14286 §4.4)
    verifications: int = Field(4, gt=0)
