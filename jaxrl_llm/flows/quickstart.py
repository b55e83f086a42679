"""`jaxrl-llm quickstart`: the whole flow on a CPU, offline, in minutes.

1. Train a small byte-level BPE tokenizer on the arithmetic task's text (saved as an HF
   tokenizer) and build a small random Llama for it.
2. SFT warm start on gold solutions until pass@1 reaches `sft.target_pass_at_1` (checked every
   `sft.eval_every` steps) or `sft.steps` run out — a policy that is right sometimes, so RL
   has positives and negatives to learn from.
3. Three `iterate` iterations (TOPR arXiv:2503.14286), each: generate n samples per prompt with
   the current policy π_i → reward → score μ = π_i → curate → train → checkpoint → HF export →
   evaluate; π_0 is evaluated first (the "before" row). The baseline c = −1 gives every
   negative the advantage R − c = 0, so each update trains on the policy's own correct answers
   (effective positive fraction 1, TOPR eq. 12): on this 0.8M-parameter policy any weight on
   the negatives broke the answer format of two-operation questions within three iterations
   (invalid rate 0.007 → 0.101 at c = −0.3 and → 0.272 at c = 0 on seed 0, up to 0.25 on
   seed 1), while c = −1 kept it ≤ 0.035 and gained the most pass@1 and pass@8
   (experiments/README.md § The quickstart's invalid answers).
4. Print a before/after table (pass@1 ± SE, pass@n, maj@K, invalid rate), render the report
   plots, check that transformers loads the export, and print every path.

`--model smollm2` runs steps 3–4 from the packaged SmolLM2-135M-Instruct GGUF (no SFT: it is
already a chat model) with fewer, shorter steps. The defaults live in `QUICKSTART_DEFAULTS`
(mirrored by `configs/quickstart.yaml`); `key=value` overrides apply on top.
"""

from __future__ import annotations

import json
import time
from typing import Any

from etils import epath
from pydantic import Field

from jaxrl_llm.config import Section, config_from_dict, load_config
from jaxrl_llm.core.atomic import atomic_directory, atomic_write_text
from jaxrl_llm.core.paths import as_path
from jaxrl_llm.core.signals import Interrupted, signal_name
from jaxrl_llm.data.shards import write_records
from jaxrl_llm.eval.evaluate import evaluate_model, format_table
from jaxrl_llm.eval.report import write_report
from jaxrl_llm.flows.iterate import IterateConfig, StageLog, experiment_part, run_iterations
from jaxrl_llm.generate.completions import gold_records
from jaxrl_llm.policy.opener import open_checkpoint, open_model
from jaxrl_llm.tasks import task_from_config
from jaxrl_llm.train.trainer import Trainer

TASK_OPTIONS = {"min_ops": 1, "max_ops": 2, "max_operand": 9}

QUICKSTART_DEFAULTS: dict[str, Any] = {
    "name": "quickstart",
    "run_dir": "runs/quickstart",
    "seed": 0,
    "model": {"source": "random", "family": "llama", "vocab_size": 384, "hidden_size": 128,
              "intermediate_size": 384, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
              "max_position_embeddings": 128},
    "loss": {"name": "topr", "baseline": -1.0},  # positives only: module docstring, step 3
    "optim": {"name": "adamw", "learning_rate": 3e-4, "clip_norm": 1.0},
    "mesh": {"data": -1},
    "train": {"steps": 40, "batch_size": 64, "max_seq_len": 96, "log_every": 5,
              "checkpoint_every": 20, "keep_checkpoints": 2},
    "generate": {"n": 8, "temperature": 1.0, "max_new_tokens": 40, "batch_size": 32},
    "data": {"task": "arithmetic", "task_options": TASK_OPTIONS, "num_prompts": 256,
             "curation": "uniform", "shuffle_seed": 0},
    "eval": {"n": 8, "num_questions": 128, "maj_k": [1, 4, 8], "bootstrap_trials": 100,
             "temperature": 1.0, "batch_size": 32},
    "iterate": {"iterations": 3},
    "sft": {"steps": 600, "learning_rate": 3e-3, "batch_size": 64, "num_prompts": 4000,
            "eval_every": 100, "target_pass_at_1": 0.2, "eval_questions": 64, "eval_n": 4},
    "tokenizer_vocab_size": 384,
}

# `--model smollm2`: the packaged 135M chat model; its forward+backward is ~50× the tiny one's.
SMOLLM2_OVERRIDES = [
    "run_dir=runs/quickstart-smollm2",
    "loss.baseline=-0.3",  # as measured (README); c = −1 is the tiny policy's (module docstring)
    "model.source=smollm2",
    "data.chat_template=true",  # an instruct model: ask in its ChatML user turn
    "generate.temperature=0.7", "eval.temperature=0.7",  # FPA arXiv:2509.19893's sampling; T=1 is mostly noise at 135M/4-bit
    "sft.steps=0", "iterate.iterations=1",
    "optim.learning_rate=1e-5",
    "train.steps=8", "train.batch_size=8", "train.max_seq_len=160", "train.log_every=2",
    "train.checkpoint_every=8",
    "generate.n=4", "generate.max_new_tokens=64", "generate.batch_size=8",
    "data.num_prompts=16",
    "eval.n=4", "eval.num_questions=16", "eval.maj_k=[1,4]", "eval.batch_size=8",
]


class SFTSection(Section):
    """The SFT warm start of the quickstart (gold solutions, FPA style)."""

    steps: int = Field(600, ge=0)  # most SFT steps
    learning_rate: float = Field(3e-3, gt=0)  # SFT learning rate
    batch_size: int = Field(64, gt=0)  # SFT records per step
    num_prompts: int = Field(4000, gt=0)  # gold solutions trained on
    eval_every: int = Field(100, gt=0)  # pass@1 probe every this many steps
    # stop SFT once the probe reaches this pass@1
    target_pass_at_1: float | None = Field(0.2, ge=0, le=1)
    eval_questions: int = Field(64, gt=0)  # probe questions
    eval_n: int = Field(4, gt=0)  # probe samples per question


class QuickstartConfig(IterateConfig):
    sft: SFTSection = Field(default_factory=SFTSection)
    # vocabulary of the byte-pair tokenizer the quickstart trains
    tokenizer_vocab_size: int = Field(384, gt=260)


def load_quickstart_config(path: str | None, overrides: list[str]) -> QuickstartConfig:
    if path is not None:
        return load_config(path, overrides, schema=QuickstartConfig)
    return config_from_dict(QUICKSTART_DEFAULTS, overrides, source="quickstart defaults",
                            schema=QuickstartConfig)


def build_tokenizer(config: QuickstartConfig, task: Any, out_dir: epath.Path) -> Any:
    """A byte-level BPE (digits split) trained on the task's prompts and gold solutions."""
    from transformers import AutoTokenizer

    from jaxrl_llm.models.tokenizer import train_bpe_tokenizer

    if (out_dir / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(out_dir))
    problems = task.load(split="train", num=2000, seed=config.seed)
    texts = [task.prompt(p) + (task.gold_completion(p) or "") for p in problems]
    tokenizer = train_bpe_tokenizer(texts, config.tokenizer_vocab_size)
    with atomic_directory(out_dir, overwrite=True) as tmp:  # a killed save leaves no half
        tokenizer.save_pretrained(str(tmp))
    return AutoTokenizer.from_pretrained(str(out_dir))


# The SFT stage weighs each gold record by R − c = 1.3 (c = −0.3), as every measured warm start
# did: Adam with clip_norm is not blind to that scale, so the RL baseline (loss.baseline) must
# not reach it, or choosing RL's baseline would change π_0.
SFT_BASELINE = -0.3


def sft_experiment(config: QuickstartConfig) -> Any:
    """The SFT stage's experiment: the quickstart's, with the `sft:` section's loss (SFT,
    baseline `SFT_BASELINE`), rate, steps, batch and probe interval."""
    s = config.sft
    sft_config = experiment_part(config).model_copy(deep=True)
    sft_config.loss.name = "sft"
    sft_config.loss.baseline = SFT_BASELINE
    sft_config.optim.learning_rate = s.learning_rate
    sft_config.optim.schedule = "constant"
    sft_config.train.steps = s.steps
    sft_config.train.batch_size = s.batch_size
    sft_config.train.eval_every = s.eval_every
    sft_config.train.checkpoint_every = s.steps
    return sft_config


def sft_warm_start(config: QuickstartConfig, tokenizer: Any, task: Any, run_dir: epath.Path, *,
                   progress: bool) -> tuple[Any, dict[str, Any]]:
    """Random init → SFT on gold solutions, stopping once pass@1 ≥ the target."""
    s = config.sft
    sft_dir = run_dir / "sft"
    log = StageLog(sft_dir)
    if log.done("train"):
        return open_checkpoint(str(sft_dir / "run"), with_tokenizer=False).model, log.stages["train"]
    records = sft_dir / "records"
    if not log.done("records"):
        problems = task.load(split="train", num=s.num_prompts, seed=config.seed + 1)
        write_records(records, gold_records(task, problems, tokenizer,
                                            eos_token_id=tokenizer.eos_token_id,
                                            chat_template=config.data.chat_template),
                      overwrite=True, task=task.name, reward_fn=task.reward_fn,
                      vocab_size=config.model.vocab_size, extra={"source": "gold"})
        log.mark("records", {"path": str(records), "num_records": len(problems)})
    sft_config = sft_experiment(config)
    probe = task.load(split="validation", num=s.eval_questions, seed=config.seed)
    e, g = config.eval, config.generate
    trainer: Trainer | None = None
    reached: list[int] = []  # the step at which the target stopped SFT (not SIGTERM)

    def eval_hook(step: int, state: Any) -> dict[str, float]:
        summary, _ = evaluate_model(
            state.model(), tokenizer, task, probe, n=s.eval_n,
            temperature=g.temperature if e.temperature is None else e.temperature,
            max_new_tokens=g.max_new_tokens, batch_size=e.batch_size or g.batch_size,
            seed=e.seed, maj_k=(1,), trials=2, chat_template=config.data.chat_template,
            sampler=config.generate.sampler_options(),
        )
        p1 = summary["pass_at_1"]["mean"]
        if progress:
            print(f"\n[sft] step {step}: pass@1 {p1:.3f} "
                  f"(invalid {summary['proportions']['invalid']:.3f})", flush=True)
        if s.target_pass_at_1 is not None and p1 >= s.target_pass_at_1 and trainer is not None:
            trainer.request_stop()
            reached.append(step)
        return {"pass_at_1": p1, "pass_at_1_se": summary["pass_at_1"]["se"],
                "invalid": summary["proportions"]["invalid"]}

    t0 = time.perf_counter()
    trainer = Trainer(sft_config, records=records, run_dir=sft_dir / "run",
                      eval_hook=eval_hook, progress=progress)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    if result.stopped and not reached:  # SIGTERM / Ctrl-C: never mark a partial SFT stage done

        raise Interrupted(f"SFT stopped by {signal_name(result.stop_signal)} at step "
                          f"{result.step}; re-run to resume", result.stop_signal)
    info = {"steps": result.step, "last": result.last_row, "seconds": time.perf_counter() - t0,
            "checkpoints": str(result.checkpoint_dir)}
    log.mark("train", info)
    return result.state.model(), info


def check_transformers_loads(export_dir: epath.Path) -> str:
    """Load the export with transformers (PyTorch) and greedy-decode a prompt; a message."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "skipped (torch not installed)"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(export_dir))
    tok = AutoTokenizer.from_pretrained(str(export_dir))
    ids = tok("Question: What is 2 + 3?", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    return f"ok ({type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} params)"\
        if out.shape[1] > ids["input_ids"].shape[1] else "loaded, but generated nothing"


def run_quickstart(config: QuickstartConfig, *, progress: bool = True) -> dict[str, Any]:
    """The whole flow; returns the paths and the before/after numbers (also `summary.json`)."""
    t_start = time.perf_counter()
    run_dir = as_path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    task = task_from_config(config)
    timings: dict[str, float] = {}
    if config.model.source == "random":
        tokenizer = build_tokenizer(config, task, run_dir / "tokenizer")
        config.model.vocab_size = len(tokenizer)
        config.data.tokenizer = str(run_dir / "tokenizer")
        model = None
        if config.sft.steps:
            t0 = time.perf_counter()
            model, _ = sft_warm_start(config, tokenizer, task, run_dir, progress=progress)
            timings["sft"] = time.perf_counter() - t0
    else:
        opened = open_model(None, config)
        model, tokenizer = opened.model, opened.tokenizer
    t0 = time.perf_counter()
    before, results = run_iterations(config, model=model, tokenizer=tokenizer, progress=progress)
    timings["rl"] = time.perf_counter() - t0
    last = results[-1]
    export_dir = last.directory / "export"
    loads = check_transformers_loads(export_dir) if export_dir.exists() else "no export"
    report = write_report(run_dir)
    timings["total"] = time.perf_counter() - t_start
    rows = [("before (π_0)", before)] if before else []
    rows += [(f"after iter {r.index}", r.eval) for r in results if r.eval is not None]
    table = format_table(rows)
    summary = {
        "before": before, "after": last.eval, "timings_s": timings,
        "paths": {
            "run_dir": str(run_dir),
            "checkpoint": str(last.directory / "train" / "checkpoints"),
            "export": str(export_dir),
            "metrics": str(last.directory / "train" / "metrics.jsonl"),
            "tensorboard": str(last.directory / "train" / "tensorboard"),
            "plots": str(report.parent),
            "report": str(report),
        },
        "transformers_load": loads,
    }
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    print("\n" + table)
    print(f"\ntransformers loads the export: {loads}")
    print(f"time: {timings['total']:.0f} s "
          + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items() if k != "total"))
    for name, path in summary["paths"].items():
        print(f"{name:>12}: {path}")
    return summary
