"""The `data:` section (data/, tasks/: records, prompts, curation, packing)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from jaxrl_llm.config.base import Section
from jaxrl_llm.core.paths import RunPath  # run/output paths: absolute (or gs://) once validated


class DataConfig(Section):
    """Task, record shards and curation (data/, tasks/, TOPR §4.3 and App. D, FPA App. B.1)."""

    # a built-in task (docs/tasks.md) or an import path package.module:factory
    # (docs/custom_tasks.md)
    task: str = "arithmetic"
    # the task's data file (JSONL/Parquet, or hf://org/name:config); a local path is made
    # absolute against the current directory when the config loads, like every other path
    task_path: RunPath | None = None
    records: RunPath | None = None  # record directory generate writes and score/curate/train read
    # uniform, target, Np (e.g. 10p), positives, anna_karenina, drop_uniform_groups, hard or dpo
    # (TOPR §4.3)
    curation: str = "uniform"
    # curation target: fraction of positive records
    target_positive_fraction: float | None = Field(None, ge=0, le=1)
    num_prompts: int = Field(256, gt=0)  # prompts to generate for
    shuffle_seed: int = 0  # seed of curation and of the loader's shuffle
    tokenizer: str | None = Field(None, description="tokenizer dir, or 'char' (default for random models)")
    chat_template: bool | None = Field(
        None, description="present each prompt as a user turn of the tokenizer's chat template "
        "(instruct models); unset: when the tokenizer has a chat template (said once on stderr "
        "where prompts go through it)")
    system_prompt: str | None = Field(
        None, description="a system message before every prompt (the chat template's system "
        "turn; without a template, the prompt's first paragraph)")
    reward_scheme: Literal["pm1", "01"] = "pm1"  # ±1 or 0/1 rewards
    task_options: dict[str, Any] = Field(default_factory=dict, description="task constructor kwargs")
    # Curation (TOPR §4.3 and App. D, FPA App. B.1): output directory, size, and a group transform applied before training.
    curated: RunPath | None = None
    # curation: records to keep (null = all the strategy gives)
    num_records: int | None = Field(None, gt=0)
    hard_power: float = Field(1.0, gt=0)  # curation hard: weight of a group's failure rate
    # per-group reward transform applied by curate (RLOO, GRPO, Dr.GRPO, PKPO)
    group_transform: Literal["none", "rloo", "grpo", "dr_grpo", "pkpo"] = "none"
    pkpo_k: int | None = Field(None, gt=0)  # PKPO's k (group_transform pkpo)
    # Loader (grain): length buckets (≤ train.max_seq_len), long records, epochs, prefetch.
    buckets: list[int] = Field(default_factory=list)
    # a record longer than train.max_seq_len: stop with an error, or drop it (counted)
    too_long: Literal["error", "drop"] = "error"
    # passes over the records; null = as many as train.steps needs
    num_epochs: int | None = Field(None, gt=0)
    read_threads: int = Field(2, gt=0)  # loader read threads
    prefetch: int = Field(2, ge=0)  # batches prepared ahead in a background thread (0 = off)
    # Sequence packing (data/loader.py): rows of train.max_seq_len holding up to
    # records_per_row records each (segment ids); not for the pair losses dpo/rpo.
    pack: bool = False
    records_per_row: int = Field(8, gt=0)  # data.pack: most records in one row

    @model_validator(mode="after")
    def _pack_has_no_buckets(self) -> DataConfig:
        if self.pack and self.buckets:
            raise ValueError(
                f"data.buckets={self.buckets} has no effect with data.pack=true (packed rows "
                "are train.max_seq_len long); unset data.buckets"
            )
        return self
