"""Typed, validated configuration: YAML files plus `a.b=c` command-line overrides.

Every section is a pydantic model with `extra="forbid"`, so an unknown key or a value of the
wrong type fails at load time with a `ConfigError` that names the dotted key and the file (or
the override) it came from. Sections are owned by the part of the package that reads them;
the defaults here are the papers' (paper sections cited per field).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_validator,
)

from jaxrl_llm.config.io import dump_config, parse_override, read_tree, validate_tree  # noqa: F401 (re-exported)
from jaxrl_llm.core.errors import ConfigError  # noqa: F401 re-exported: defined apart so leaves need no schema
from jaxrl_llm.core.paths import RunPath  # run/output paths: absolute (or gs://) once validated
from jaxrl_llm.losses.options import Option
from jaxrl_llm.losses.registry import OPTIONS, LossSpec, loss_spec, option_problem, owners


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class LoraConfig(Section):
    """LoRA adapters (models/lora.py; LoRA arXiv:2106.09685): only they are trained, the base
    weights stay frozen, and the reference policy is the base (adapters off)."""

    rank: int = Field(8, gt=0)  # r, the adapters' inner width
    alpha: float = Field(16.0, gt=0)  # the update is scaled by alpha / rank
    # PEFT / HF module names (models.lora.LORA_TARGETS); default: every linear layer.
    targets: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj"]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj"], min_length=1)


class ModelConfig(Section):
    """Which decoder to train, and its numerics (models/)."""

    # where the weights come from: random init, an HF directory or Hub id, a GGUF file, or the
    # packaged SmolLM2-135M-Instruct GGUF (docs/integrations.md)
    source: Literal["random", "hf", "gguf", "smollm2"] = "random"
    path: str | None = Field(None, description="HF directory or GGUF file for source hf/gguf, "
                             "or a Hugging Face Hub id (org/name) for source hf")
    revision: str | None = Field(None, description="hub revision (branch, tag, commit) of a hub id")
    # random models: the decoder family (pretrained sources read theirs)
    family: Literal["llama", "mistral", "qwen2", "qwen3", "gemma2"] = "llama"
    # Architecture of a random-init model (ignored when loading weights, which carry their own).
    vocab_size: int = Field(512, gt=0)  # random models: vocabulary size
    hidden_size: int = Field(128, gt=0)  # random models: hidden width d
    intermediate_size: int = Field(384, gt=0)  # random models: MLP width
    num_layers: int = Field(2, gt=0)  # random models: decoder layers
    num_heads: int = Field(4, gt=0)  # random models: query heads
    num_kv_heads: int = Field(2, gt=0)  # random models: key/value heads (grouped-query attention)
    # random models: per-head width; null = hidden_size / num_heads
    head_dim: int | None = Field(None, gt=0)
    # random models: the longest position RoPE is set up for
    max_position_embeddings: int = Field(2048, gt=0)
    rope_theta: float = Field(10_000.0, gt=0)  # random models: RoPE base
    rms_norm_eps: float = Field(1e-6, gt=0)  # random models: RMSNorm epsilon
    # Mistral: every layer; Gemma 2: the even (local) layers. None = full attention everywhere.
    sliding_window: int | None = Field(None, gt=0)
    tie_embeddings: bool = True  # random models: the unembedding is the embedding's transpose
    # auto: bfloat16 on TPU/GPU (with optim.master_weights_fp32 the optimizer keeps fp32
    # master weights; the log-prob kernel's log-softmax is fp32), float32 on CPU.
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # dtype of the activations and matmuls; auto: bfloat16 on TPU/GPU, float32 on CPU
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Default by source (`_memory_sane_defaults`): pretrained sources scan the layers and
    # rematerialise them (full), random models neither. Measured by `plan` for SmolLM2-135M at
    # 4×768 tokens on CPU: 13.9 GiB peak unrolled, 3.5 GiB scanned with remat=full.
    remat: Literal["none", "full", "dots", "dots_no_batch"] = Field(
        "none", description="activation rematerialisation of each layer in the backward pass "
        "(needs scan_layers); default: full for pretrained sources (hf, gguf, smollm2), none "
        "for random")
    scan_layers: bool = Field(
        False, description="run the layers under one jax.lax.scan (stacked weights); default: "
        "true for pretrained sources, false for random")
    lora: LoraConfig | None = None  # None: full fine-tuning
    # Attention kernel (models/attention.py): auto = splash on TPU, cuDNN on GPU, jnp on CPU.
    attention: Literal["auto", "jnp", "xla", "cudnn", "splash"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _memory_sane_defaults(cls, data: Any) -> Any:
        """Unset remat / scan_layers: full + scanned for pretrained weights (a real model's
        activations dominate memory), none + unrolled for random (tiny test) models."""
        if isinstance(data, Mapping):
            pretrained = data.get("source", "random") != "random"
            data = dict(data)
            if data.get("scan_layers") is None:
                data["scan_layers"] = pretrained
            if data.get("remat") is None:
                data["remat"] = "full" if pretrained and data["scan_layers"] is True else "none"
        return data

    @model_validator(mode="after")
    def _remat_needs_scan(self) -> ModelConfig:
        # Unrolled, XLA schedules the recomputed layers early and keeps the activations anyway
        # (plan, SmolLM2-135M at 4×768 on CPU: 13.4 GiB with remat=full vs 13.9 without).
        if self.remat != "none" and not self.scan_layers:
            raise ValueError(
                f"model.remat={self.remat} saves no memory with model.scan_layers=false (the "
                "compiler keeps every layer's activations when the layers are unrolled): set "
                "model.scan_layers=true, or model.remat=none")
        return self


class _LossSection(Section):
    """Which loss kernel and its options (losses/, docs/kernels.md).

    Each loss's options are declared in its registry entry (`losses.registry`: type, default,
    bounds, the kernel keyword) and set flat as `loss.<key>`; `LossConfig` below adds them as
    fields. Setting a strict option (`Option.strict`, most are) of another loss than `name`
    is an error."""

    # A name of `losses.registry.LOSS_SPECS` (checked below against that one table).
    name: str = "topr"
    # subtracted from each reward (TOPR eq. 12: baselines as dataset composition); read by
    # the TOPR family and ppo, by curate, and by train.grad_norm_by_sign's split
    baseline: float = 0.0
    # vocabulary columns per chunk of the log-prob kernel (peak memory vs speed, docs/kernels.md)
    logprob_chunk_size: int = Field(4096, gt=0)
    # μ for π/μ: trainer = the score pass's mu_logprobs, sampler = the sampler's own log-probs
    mu_source: Literal["trainer", "sampler"] = "trainer"

    @field_validator("name")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        loss_spec(name)  # ValueError listing the choices
        return name

    @model_validator(mode="after")
    def _options_read_by_the_loss(self) -> _LossSection:
        """An option the chosen loss does not read is an error, never silently ignored; then
        the loss's own checks of its values (`registry.option_problem`)."""
        problem = option_problem(self.spec, dict(self))
        if problem:
            raise ValueError(problem)
        return self

    @property
    def spec(self) -> LossSpec:
        """The registry entry of `name` (checked when the section was validated): what the
        rest of the package reads about the chosen loss, instead of looking it up by name.
        Not stored on the model, so copies and equality see only the config's values."""
        return loss_spec(self.name)


def _option_field(option: Option) -> tuple[Any, Any]:
    """A registry option as a pydantic field; its description names the losses reading it."""
    return option.type, Field(option.default, description=f"{', '.join(owners(option.key))}: "
                              f"{option.doc}", **option.bounds())


# The `loss:` section: the fields above plus every registry option (`registry.OPTIONS`).
LossConfig = create_model(  # type: ignore[call-overload]
    "LossConfig", __base__=_LossSection, __module__=__name__, __doc__=_LossSection.__doc__,
    **{key: _option_field(option) for key, option in OPTIONS.items()},
)


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


class TrainConfig(Section):
    """The trainer loop (train/)."""

    # optimizer steps (train stops earlier when data.num_epochs runs out)
    steps: int = Field(100, gt=0)
    batch_size: int = Field(8, gt=0)  # records (rows) per step, over all devices
    # split each step into micro-batches of this many rows (gradients accumulated: the same update);
    # null = one; picked automatically when the step would not fit
    micro_batch_size: int | None = Field(None, gt=0)
    # tokens per row (prompt + completion); a longer record is an error (data.too_long)
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
    # evaluate held-out pass@1 ± SE every this many steps (eval.* keys; `jaxrl-llm train`)
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


class PlanConfig(Section):
    """`jaxrl-llm plan`: the hardware to compile the train step for (no weights, no devices).

    `platform: tpu` compiles with the real TPU compiler for `topology` (needs the `tpu`
    extra, PyPI `libtpu`); `cpu` uses `num_devices` fake host devices (`XLA_FLAGS`).
    """

    # compile for fake CPU devices or, with libtpu, real TPU chips
    platform: Literal["cpu", "tpu"] = "cpu"
    topology: str | None = Field(None, description="e.g. v5e:16x16 (256 chips), v5e:2x2")
    num_devices: int | None = Field(None, gt=0, description="fake CPU devices; default: mesh")
    chip_memory_gib: float | None = Field(None, gt=0, description="HBM per chip; v5e: 16")


class GenerateConfig(Section):
    """Sampling for the offline dataset (generate/); TOPR's set-up is T=1, top-k 500."""

    # jax: the project's KV-cache sampler; vllm: vLLM (a GPU host, or vLLM-CPU)
    backend: Literal["jax", "vllm"] = "jax"
    n: int = Field(16, gt=0)  # completions per prompt
    temperature: float = Field(1.0, ge=0)  # sampling temperature (0 = greedy)
    top_p: float = Field(1.0, gt=0, le=1)  # nucleus sampling (1 = off)
    top_k: int = Field(0, ge=0)  # top-k sampling (0 = off)
    max_new_tokens: int = Field(512, gt=0)  # longest completion
    # prompts per sampler batch (fewer when the KV cache would not fit)
    batch_size: int = Field(32, gt=0)
    split: str = "train"  # task split to sample prompts from
    output: RunPath | None = Field(None, description="record directory generate writes (local or gs://); default: data.records")
    records_per_shard: int = Field(10_000, gt=0)  # records per ArrayRecord shard
    stop_at_eos: bool = True  # end a completion at the tokenizer's EOS
    chunk_prompts: int | None = Field(None, gt=0, description="prompts per resumable chunk "
                                      "(vllm backend; default 256)")
    # vLLM (generate/vllm.py): what its `logprobs` mean, and engine options.
    vllm_logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="vLLM's dtype; auto: float32 on CPU, bfloat16 on a GPU")
    vllm_max_model_len: int | None = Field(None, gt=0, description="default: the longest prompt "
                                           "+ max_new_tokens")
    vllm_kv_cache_gib: int = Field(1, gt=0, description="vLLM-CPU's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    tensor_parallel_size: int = Field(1, gt=0)  # vLLM: GPUs per engine
    # vLLM: fraction of GPU memory the engine may take
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # Score pass (docs/architecture.md § Why μ is re-scored): μ per-token log-probs with the trainer's numerics.
    score_batch_size: int = Field(8, gt=0)
    score_output: RunPath | None = Field(None, description="scored record directory (default: <records>-scored)")
    # Score pass: flag sequences whose |Σ log μ_sampler − Σ log μ_trainer| exceeds this (nats);
    # with drop_mismatched, leave them out of the scored records (counts in the report).
    max_mismatch: float | None = Field(None, gt=0)
    # score: leave sequences over generate.max_mismatch out instead of flagging them
    drop_mismatched: bool = False


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
        "(instruct models); unset: when the tokenizer has a chat template (said on stderr)")
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


class MetricsConfig(Section):
    """Where metric rows go besides metrics.jsonl and TensorBoard (train/metrics_log.py)."""

    wandb: bool = Field(False, description="also log to Weights & Biases (extra: wandb)")
    wandb_project: str = "jaxrl-llm"  # W&B project
    wandb_entity: str | None = None  # W&B entity (team); null = your default
    wandb_name: str | None = Field(None, description="default: the experiment's name")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="default: wandb's own (WANDB_MODE)")
    wandb_tags: list[str] = Field(default_factory=list)  # W&B tags


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

    @model_validator(mode="after")
    def _pack_needs_unpaired_loss(self) -> ExperimentConfig:
        # The one config-level check; the loader and the loss guard their own inputs too.
        if self.data.pack and self.loss.spec.needs_pairs:
            raise ValueError(
                f"data.pack=true cannot train loss.name={self.loss.name}: its pairs index rows "
                "(pair_index), not packed records; set data.pack=false"
            )
        return self


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
