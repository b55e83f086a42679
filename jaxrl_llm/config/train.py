"""The sections `train` reads: `optim:`, `mesh:`, `train:` and `metrics:`."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from jaxrl_llm.config.base import Section


class OptimConfig(Section):
    """optax optimizer, schedule and clipping (train/optim)."""

    name: Literal["adamw", "adafactor", "sgd"] = "adamw"  # optax optimizer
    learning_rate: float = Field(1e-5, gt=0)  # peak learning rate
    # learning-rate schedule
    schedule: Literal["constant", "warmup_constant", "warmup_cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)  # linear warm-up steps (warmup_* schedules)
    weight_decay: float = Field(0.0, ge=0)  # decoupled weight decay (adamw)
    b1: float = Field(0.9, ge=0, lt=1)  # Adam β₁
    b2: float = Field(0.999, ge=0, lt=1)  # Adam β₂
    clip_norm: float | None = Field(1.0, gt=0)  # global gradient-norm clip; null = none
    # keep float32 master weights when the model's params are bfloat16
    master_weights_fp32: bool = True
    eps: float = Field(1e-8, gt=0)  # Adam ε
    decay_steps: int | None = Field(None, gt=0, description="cosine decay length; default train.steps")
    # warmup_cosine: final learning rate as a fraction of the peak
    end_lr_ratio: float = Field(0.0, ge=0, le=1)
    # AdamW's first moment in bfloat16 (optax `mu_dtype`): halves its memory; a precision
    # trade-off (8 mantissa bits for a running average), so float32 unless asked for.
    mu_dtype: Literal["float32", "bfloat16"] = "float32"


class MeshConfig(Section):
    """Device mesh axes (parallel/): sizes must multiply to the device count; -1 = the rest."""

    data: int = -1  # data-parallel axis size (-1: the devices the other axes leave)
    fsdp: int = 1  # fully-sharded axis: parameters and optimizer state split over it
    tensor: int = 1  # tensor-parallel axis (heads and MLP width split)
    # context-parallel axis: each row's tokens split over it (load-balanced causal order,
    # keys/values all-gathered in attention; docs/plan.md § Context parallelism).
    # 2 × context must divide train.max_seq_len (and every data.buckets length).
    context: int = Field(1, gt=0)
    # expert-parallel axis: a mixture of experts' experts split over it (it must divide the
    # model's experts) and, outside the experts, the batch's rows (models/moe_dispatch.py)
    expert: int = Field(1, gt=0)


class TrainConfig(Section):
    """The trainer loop (train/)."""

    # optimizer steps (train stops earlier when data.num_epochs runs out)
    steps: int = Field(100, gt=0)
    batch_size: int = Field(8, gt=0)  # records (rows) per step, over all devices
    # split each step into micro-batches of this many rows (gradients accumulated: the same update);
    # null = one; picked automatically when the step would not fit
    micro_batch_size: int | None = Field(None, gt=0)
    # tokens per row (prompt + completion); a longer record is an error (data.too_long); at
    # most the model's max_position_embeddings (after model.rope_scaling)
    max_seq_len: int = Field(512, gt=0)
    log_every: int = Field(10, gt=0)  # a metrics row every this many steps
    # an Orbax checkpoint every this many steps (and at the end)
    checkpoint_every: int = Field(100, gt=0)
    # checkpoints kept (the newest; an older one is deleted only once the next is committed,
    # and resume, iterate, evaluate and export read the newest): each holds 12 bytes a
    # parameter with AdamW (docs/plan.md, "Disk")
    keep_checkpoints: int = Field(1, gt=0)
    # dtype the checkpoint stores the parameters (and a frozen reference) in: bfloat16 halves
    # their bytes (the AdamW moments stay float32); a run resumed from it starts from rounded
    # weights, so it is not bit-exact (a warning says so); export and evaluate read it as usual
    checkpoint_dtype: Literal["float32", "bfloat16"] = "float32"
    # evaluate held-out pass@1 ± SE before step 1, every this many steps (updates in `online`)
    # and after the last one, one metrics row each (eval.* keys; `jaxrl-llm train` and `online`)
    eval_every: int | None = Field(None, gt=0)
    # Reference log-probs for DPO/RPO/KTO/A*-PO/off_rl_kl: precomputed in `batch.ref_logprobs`
    # ("batch") or computed in the train step from a frozen copy of the initial policy
    # ("model"). FPA always runs the frozen reference forward (it needs hidden states).
    ref_logprobs: Literal["batch", "model"] = "batch"
    # The trainer stops after this many consecutive steps skipped for a non-finite loss/grad.
    max_nonfinite_steps: int = Field(3, gt=0)
    # Log grad_norm_positive/negative too (2 extra forward+backward passes per micro-batch).
    grad_norm_by_sign: bool = False
    # With micro-batches, scanned layers and remat: full, add each layer's gradient into the
    # float32 accumulator inside the layer scan's backward pass (models/layer_scan.py): no
    # stacked, parameter-sized micro-batch gradient (same gradients, less memory).
    accumulate_in_layer_scan: bool = True
    # Debug: log each step's consumed records to run_dir/record_trace.jsonl (train/record_trace.py).
    record_trace: bool = False
    # Before step 1, compare the compiled step's peak memory with the memory left and pick
    # micro-batches or refuse with the figure (parallel/memory.py); false starts anyway.
    check_memory: bool = True
    # Train even when the records give the loss nothing to learn (data/signal.py): no record
    # it raises (TOPR family, PPO: none with R − loss.baseline > 0; Off-RL, FPA: none with
    # R > 0), so it only pushes probability down, or every group's rewards equal (GRPO-style
    # group baselines: every advantage 0). false: `jaxrl-llm train` refuses such records,
    # naming the fractions.
    allow_no_signal: bool = False

    @model_validator(mode="after")
    def _micro_divides(self) -> TrainConfig:
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.micro_batch_size={self.micro_batch_size} must divide "
                f"train.batch_size={self.batch_size}"
            )
        return self


class MetricsConfig(Section):
    """Where metric rows go besides metrics.jsonl and TensorBoard (train/metrics_log.py)."""

    wandb: bool = Field(False, description="also log to Weights & Biases (extra: wandb)")
    wandb_project: str = "jaxrl-llm"  # W&B project
    wandb_entity: str | None = None  # W&B entity (team); null = your default
    wandb_name: str | None = Field(None, description="default: the experiment's name")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="default: wandb's own (WANDB_MODE)")
    wandb_tags: list[str] = Field(default_factory=list)  # W&B tags
