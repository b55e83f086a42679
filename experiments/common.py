"""Shared pieces of the toy-scale reproductions: the SFT-warmed policy, configs, evaluation
during training, and result files.

Every stage runs through the commands users type (`jaxrl_llm.cli.main`, i.e. `jaxrl-llm
generate|train|export|score|curate|evaluate`, called in-process so the interpreter and JAX
start once) or through the public `Trainer` + `evaluate_model` API.

The shared policy: a 2-layer, 64-wide decoder on the character tokenizer, trained here by SFT
on gold solutions of one-operation arithmetic (operands 1–3) until it is right a few times in
ten at T = 1. It is built once per cache directory and reused by every experiment.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import yaml

from experiments import redraw

# The task and model every experiment shares (a tiny model SFTs in ~1 minute on 2 cores).
TASK_OPTIONS = {"min_ops": 1, "max_ops": 1, "max_operand": 3}
MODEL = {"source": "random", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "max_position_embeddings": 256}
# SFT sizes: full → pass@1 ≈ 0.1–0.4 at T = 1 on the test split (it climbs from 0.12 at 400
# steps to 0.64 at 800 at this learning rate); smoke → a weaker model, sooner.
WARM_SIZES = {"full": {"gold_prompts": 512, "sft_steps": 500},
              "smoke": {"gold_prompts": 256, "sft_steps": 100}}


def jaxrl(*argv: str) -> None:
    """`jaxrl-llm ARGV` in this process; a non-zero exit is an error naming the command."""
    from jaxrl_llm.cli import main

    code = main(list(argv))
    if code != 0:
        raise RuntimeError(f"jaxrl-llm {' '.join(argv)} exited {code}")


def base_config(model: dict[str, Any], *, seed: int = 0, **sections: dict[str, Any]) -> dict:
    """An experiment config (the schema of `configs/*.yaml`) for the shared task."""
    config: dict[str, Any] = {
        "name": "experiment", "run_dir": "runs/experiment", "seed": seed, "model": model,
        "optim": {"learning_rate": 0.003},
        "train": {"steps": 300, "batch_size": 16, "max_seq_len": 160, "log_every": 50,
                  "checkpoint_every": 100000},
        "generate": {"n": 4, "temperature": 1.0, "max_new_tokens": 48, "batch_size": 64},
        "data": {"task": "arithmetic", "num_prompts": 64, "task_options": TASK_OPTIONS},
        "eval": {"n": 4, "num_questions": 32, "batch_size": 64, "maj_k": [1, 4],
                 "bootstrap_trials": 10},
    }
    for name, values in sections.items():  # a section's keys update it; a scalar replaces
        config[name] = {**config.get(name, {}), **values} if isinstance(values, dict) else values
    return config


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def warm_policy(cache: Path, *, smoke: bool = False, sizes: dict[str, int] | None = None,
                **sections: dict[str, Any]) -> dict[str, Any]:
    """The SFT-warmed policy in `cache/models/sft` (built once): `generate --gold` →
    `train loss.name=sft` → `export` → `evaluate`. Returns `cache/warm.json`'s content.
    `sizes` replaces `WARM_SIZES`'s entry; `sections` update the config's sections (another
    task variant: `data={"task_options": ...}`, longer `train.max_seq_len`)."""
    cache = cache.resolve()
    info_path = cache / "warm.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    t0 = time.perf_counter()
    sizes = sizes or WARM_SIZES["smoke" if smoke else "full"]
    train = {"steps": sizes["sft_steps"], "log_every": 50, **sections.pop("train", {})}
    data = {"records": str(cache / "gold"), **sections.pop("data", {})}
    cfg = write_config(cache / "sft.yaml", base_config(
        MODEL, train=train, data=data, run_dir=str(cache / "sft"), **sections))
    jaxrl("generate", "--config", str(cfg), "--gold", "--out", str(cache / "gold"),
          f"data.num_prompts={sizes['gold_prompts']}")
    jaxrl("train", "--config", str(cfg), "--records", str(cache / "gold"), "--no-progress",
          "loss.name=sft", f"run_dir={cache / 'sft'}")
    jaxrl("export", "--checkpoint", str(cache / "sft" / "checkpoints"),
          "--out", str(cache / "models" / "sft"))
    jaxrl("evaluate", "--config", str(cfg), "--model", str(cache / "models" / "sft"),
          "--out", str(cache / "eval"), "eval.num_questions=64")
    summary = json.loads((cache / "eval" / "eval.json").read_text())
    info = {"model": str(cache / "models" / "sft"), "smoke": smoke, **sizes,
            "pass_at_1": summary["pass_at_1"]["mean"], "pass_at_1_se": summary["pass_at_1"]["se"],
            "invalid": summary["proportions"]["invalid"],
            "seconds": round(time.perf_counter() - t0, 1)}
    info_path.write_text(json.dumps(info, indent=2))
    return info


def warm_model_section(warm: dict[str, Any]) -> dict[str, Any]:
    return {"source": "hf", "path": warm["model"]}


# The quickstart's testbed (`jaxrl-llm quickstart`'s policy before RL): a 4-layer, 128-wide
# Llama (0.83M parameters) on a byte-level BPE tokenizer trained on the task's text, SFT-warmed
# on gold solutions of one- or two-operation arithmetic (operands 1–9) until pass@1 ≥ 0.2 on
# 64 validation questions. Built by `jaxrl_llm.flows.quickstart`'s own functions (`build_tokenizer`,
# `sft_warm_start`) from `QUICKSTART_DEFAULTS`; smoke → fewer SFT steps and gold prompts.
QUICKSTART_SMOKE_OVERRIDES = ["sft.steps=10", "sft.num_prompts=64", "sft.batch_size=8", "sft.eval_every=10",
                              "sft.eval_questions=8", "sft.eval_n=2"]
# Pass@1 of the warm policy measured on these many questions × samples per split (T = 1);
# the validation questions use problem seed 1, not the seed-0 ones SFT stopped on.
QUICKSTART_MEASURE = {"full": {"questions": 256, "n": 8}, "smoke": {"questions": 8, "n": 2}}
VALIDATION_SEED = 1


def quickstart_sections(warm: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The config sections an experiment on the quickstart testbed needs beside its model:
    the quickstart's task options and sequence lengths (to pass to `base_config`)."""
    return {key: dict(value) for key, value in warm["sections"].items()}


def warm_policy_quickstart(cache: Path, *, smoke: bool = False,
                           smoke_overrides: list[str] | None = None,
                           overrides: list[str] | None = None) -> dict[str, Any]:
    """The quickstart's SFT-warmed policy as an HF directory `cache/models/sft` (built once):
    `quickstart.build_tokenizer` → `quickstart.sft_warm_start` (the quickstart's own stage,
    stopping at its pass@1 target) → `export.atomic_save` with the tokenizer; then pass@1 ± SE
    on a validation split and on test. Returns `cache/warm.json`'s content, whose `sections`
    are the config sections experiments on this policy use (`quickstart_sections`).
    `smoke_overrides` replace `QUICKSTART_SMOKE_OVERRIDES` (a smoke policy that answers);
    `overrides` apply in both modes (another architecture, e.g. a mixture of experts: the cache
    directory must then be the variant's own)."""
    from jaxrl_llm.eval.evaluate import evaluate_model
    from jaxrl_llm.flows.quickstart import (
        QUICKSTART_DEFAULTS,
        build_tokenizer,
        load_quickstart_config,
        sft_warm_start,
    )
    from jaxrl_llm.policy.export import atomic_save
    from jaxrl_llm.tasks import task_from_config

    cache = cache.resolve()
    info_path = cache / "warm.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        # the cache moves with its directory (e.g. copied to another machine)
        return {**info, "model": str(cache / "models" / "sft")}
    t0 = time.perf_counter()
    overrides = [f"run_dir={cache / 'quickstart'}", *(overrides or [])]
    smoke_sft = smoke_overrides or QUICKSTART_SMOKE_OVERRIDES
    config = load_quickstart_config(None, overrides + (smoke_sft if smoke else []))
    task = task_from_config(config)
    run_dir = cache / "quickstart"
    run_dir.mkdir(parents=True, exist_ok=True)
    # as `run_quickstart` does before SFT: the tokenizer fixes the vocabulary
    tokenizer = build_tokenizer(config, task, run_dir / "tokenizer")
    config.model.vocab_size = len(tokenizer)
    config.data.tokenizer = str(run_dir / "tokenizer")
    model, sft = sft_warm_start(config, tokenizer, task, run_dir, progress=False)
    model_dir = atomic_save(model, cache / "models" / "sft", tokenizer=tokenizer, overwrite=True)
    measure = QUICKSTART_MEASURE["smoke" if smoke else "full"]
    g = config.generate
    splits: dict[str, dict[str, float]] = {}
    for split, seed in (("validation", VALIDATION_SEED), ("test", 0)):
        problems = task.load(split=split, num=measure["questions"], seed=seed)
        summary, _ = evaluate_model(model, tokenizer, task, problems, n=measure["n"],
                                    temperature=g.temperature, max_new_tokens=g.max_new_tokens,
                                    batch_size=g.batch_size, seed=1234, maj_k=(1,), trials=2)
        splits[split] = {"pass_at_1": float(summary["pass_at_1"]["mean"]),
                         "pass_at_1_se": float(summary["pass_at_1"]["se"]),
                         "invalid": float(summary["proportions"]["invalid"]),
                         "questions": measure["questions"], "n": measure["n"],
                         "problem_seed": seed}
    defaults = QUICKSTART_DEFAULTS
    info = {"model": str(model_dir), "testbed": "quickstart", "smoke": smoke,
            "num_params": int(sum(np.size(x) for x in _leaves(model))),
            "sft_steps": int(sft["steps"]), "sft_overrides": overrides[1:] + (
                smoke_sft if smoke else []),
            "pass_at_1": splits["test"]["pass_at_1"],
            "pass_at_1_se": splits["test"]["pass_at_1_se"],
            "invalid": splits["test"]["invalid"], "splits": splits,
            "sections": {"data": {"task_options": dict(config.data.task_options)},
                         "train": {"max_seq_len": defaults["train"]["max_seq_len"]},
                         "generate": {"max_new_tokens": g.max_new_tokens}},
            "seconds": round(time.perf_counter() - t0, 1)}
    info_path.write_text(json.dumps(info, indent=2))
    return info


def _leaves(model: Any) -> list[Any]:
    import jax
    from flax import nnx

    return jax.tree.leaves(nnx.state(model, nnx.Param))


class Probe:
    """Pass@1 and invalid rate of a model on fixed test questions with a fixed sampling seed
    (common random numbers: every checkpoint is scored on the same draws)."""

    def __init__(self, config: Any, *, num_questions: int, n: int, seed: int = 1234,
                 split: str = "test", problem_seed: int = 0) -> None:
        from jaxrl_llm.tasks import task_from_config

        self.config = config
        self.task = task_from_config(config)
        self.problems = self.task.load(split=split, num=num_questions, seed=problem_seed)
        self.n, self.seed = n, seed
        self._tokenizer: Any = None

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.model.path)
        return self._tokenizer

    progress = True  # the evaluation's progress bar

    def evaluate(self, model: Any) -> tuple[dict[str, Any], Any]:
        """`evaluate_model` on the fixed questions and draws: (eval.json dict, graded samples)."""
        from jaxrl_llm.eval.evaluate import evaluate_model

        g = self.config.generate
        return evaluate_model(model, self.tokenizer(), self.task, self.problems, n=self.n,
                              temperature=g.temperature, max_new_tokens=g.max_new_tokens,
                              batch_size=g.batch_size, seed=self.seed, maj_k=(1,), trials=2,
                              progress=self.progress)

    def __call__(self, model: Any) -> dict[str, float]:
        summary, _ = self.evaluate(model)
        return self.row(summary)

    @staticmethod
    def row(summary: dict[str, Any]) -> dict[str, float]:
        return {"pass_at_1": float(summary["pass_at_1"]["mean"]),
                "pass_at_1_se": float(summary["pass_at_1"]["se"]),
                "invalid": float(summary["proportions"]["invalid"])}


class SequenceLogprobs:
    """log π(y|x) − log π_ref(y|x) of fixed scored records under a model (FPA arXiv:2509.19893
    Fig. 2's quantity), at T = 1 through the `score` pass's forward (`make_scorer` /
    `score_batch`, the trainer's numerics); π_ref is the records' `ref_logprobs`, which
    `jaxrl-llm score` wrote from the initial policy. Built once (one compiled forward);
    each call swaps in the given model's parameters."""

    def __init__(self, records: Sequence[Any], reference_model: Any, *,
                 batch_size: int = 64) -> None:
        from jaxrl_llm.train.score import make_scorer

        if any(r.ref_logprobs is None for r in records):
            raise ValueError("SequenceLogprobs needs scored records (ref_logprobs): run "
                             "`jaxrl-llm score` on them first")
        self.records = list(records)
        self.batch_size = batch_size
        self.ref = np.array([float(np.sum(r.ref_logprobs)) for r in self.records])
        self.lengths = np.array([r.completion_ids.size for r in self.records], np.float64)
        self.scorer = make_scorer(reference_model, temperature=1.0)

    def logprobs(self, model: Any) -> np.ndarray:
        """Σ_t log π(y_t | x, y_<t) per record [N] under `model`."""
        import jax

        from jaxrl_llm.parallel.rules import state_shardings
        from jaxrl_llm.train.score import score_batch
        from jaxrl_llm.train.state import split_model

        _, params, _ = split_model(model)
        self.scorer.params = jax.tree.map(jax.device_put, params,
                                          state_shardings(params, self.scorer.mesh))
        out: list[float] = []
        for i in range(0, len(self.records), self.batch_size):
            chunk = self.records[i:i + self.batch_size]
            out += [float(np.sum(ref_t1)) for _, ref_t1 in
                    score_batch(self.scorer, chunk, self.batch_size)]
        return np.array(out)

    def __call__(self, model: Any) -> np.ndarray:
        """log π(y|x) − log π_ref(y|x) per record [N]."""
        return self.logprobs(model) - self.ref


def train_with_probe(config: Any, probe: Callable[[Any], dict[str, float]], *, eval_every: int,
                     records: str | None = None) -> list[dict[str, float]]:
    """Train `config` with the public Trainer, probing the policy every `eval_every` steps;
    rows `{step, pass_at_1, invalid, ...}` for the probed steps."""
    from jaxrl_llm.train.trainer import Trainer

    rows: list[dict[str, float]] = []

    def hook(step: int, state: Any) -> dict[str, float]:
        row = probe(state.model())
        rows.append({"step": step, **row})
        return row

    config = config.model_copy(deep=True)
    config.train.eval_every = eval_every
    trainer = Trainer(config, records=records, eval_hook=hook, progress=False, tensorboard=False)
    try:
        trainer.run()
    finally:
        trainer.close()
    if not rows:  # e.g. a finished run in run_dir: the Trainer resumed and had nothing to do
        raise RuntimeError(f"{config.run_dir}: no step was probed (train.steps="
                           f"{config.train.steps}, eval_every={eval_every}); start from an "
                           "empty run_dir")
    return rows


def load_policy(path: str, config: Any) -> Any:
    """The model of an HF directory with the config's numerics (the loader `evaluate` uses)."""
    from jaxrl_llm.policy.opener import open_model

    return open_model(path, config, key="--model").model


def _check_finite(obj: Any, where: str = "results") -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_finite(v, f"{where}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _check_finite(v, f"{where}[{i}]")
    elif isinstance(obj, float) and not math.isfinite(obj):
        raise FloatingPointError(f"{where} is {obj}: refusing to write a non-finite result")


def write_results(out: Path, name: str, results: dict[str, Any]) -> Path:
    """`out/NAME.json`, refusing NaN/inf anywhere in it."""
    _check_finite(results)
    path = out / f"{name}.json"
    path.write_text(json.dumps(results, indent=2))
    return path


def parse_args(description: str, default_out: str,
               extra: Callable[[Any], None] | None = None,
               cache_name: str = "warm_policy", smoke_cache_name: str | None = None) -> Any:
    import argparse

    from experiments import redraw

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=default_out, help="output directory (PNG + JSON)")
    parser.add_argument("--cache", default=None,
                        help="where the shared SFT-warmed policy is built once (default: "
                             f"OUT/../{cache_name}, or {cache_name}_smoke with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; under a minute")
    parser.add_argument("--results-dir", default=None,
                        help="where the results the figure was drawn from are copied as "
                             "PNG-STEM.json (default: experiments/results, none with --smoke; "
                             "'none': no copy); see experiments/redraw.py")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    args.out = Path(args.out).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.results_dir = redraw.results_dir_arg(args.results_dir, args.smoke)
    smoke_name = smoke_cache_name or f"{cache_name}_smoke"
    if getattr(args, "testbed", "char") == "quickstart":  # experiments/testbed.py
        cache_name, smoke_name = "warm_policy_quickstart", "warm_policy_quickstart_smoke_sft"
    default_cache = args.out.parent / (smoke_name if args.smoke else cache_name)
    args.cache = Path(args.cache).resolve() if args.cache else default_cache
    return args


TESTBEDS = ("char", "quickstart")


def add_testbed_args(parser: Any) -> None:
    """`--testbed` and `--seeds` of the claim-2 and claim-4 scripts (experiments/testbed.py)."""
    parser.add_argument("--testbed", choices=TESTBEDS, default="char",
                        help="char: the 2-layer character-level policy (sections full/smoke); "
                             "quickstart: the quickstart's SFT policy (full_quickstart/"
                             "smoke_quickstart)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run only these of the section's seeds (finished runs in OUT "
                             "are reused)")


def testbed_section(args: Any) -> str:
    """The config section the arguments select: `full` / `smoke`, `_quickstart` appended
    with `--testbed quickstart`."""
    return ("smoke" if args.smoke else "full") + \
        ("_quickstart" if getattr(args, "testbed", "char") == "quickstart" else "")


def run_experiment(doc: str, name: str, config: Path,
                   run: Callable[[Any, dict[str, Any]], dict[str, Any]],
                   plot: Callable[[dict[str, Any], Path], Any], *,
                   cache_name: str = "warm_policy",
                   extra: Callable[[Any], None] | None = None, testbeds: bool = False,
                   smoke_cache_name: str | None = None) -> None:
    """The `main()` of an experiment script: parse `--out/--smoke`, run the config's `full` or
    `smoke` section, record wall and CPU seconds, write `results.json` and `NAME.png`.
    `testbeds`: `--testbed quickstart` runs `full_quickstart` / `smoke_quickstart` and writes
    `NAME_quickstart.png` (experiments/testbed.py; `--seeds` cuts the section's seeds)."""
    args = parse_args(doc.splitlines()[0], f"runs/experiments/{name}",
                      extra=add_testbed_args if testbeds else extra, cache_name=cache_name,
                      smoke_cache_name=smoke_cache_name)
    cfg = yaml.safe_load(config.read_text())[testbed_section(args)]
    if getattr(args, "seeds", None):
        cfg["seeds"] = [s for s in cfg["seeds"] if s in args.seeds]
        cfg["select_seeds"] = [s for s in cfg.get("select_seeds", []) if s in args.seeds]
    t0 = time.perf_counter()
    results = run(args, cfg)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    # CPU time of all this process's threads: on a shared machine, wall time / cores overstates
    # an idle machine's time; CPU seconds / 2 bounds the 2-core wall time from below.
    results["cpu_seconds"] = round(time.process_time(), 1)
    write_results(args.out, "results", results)
    png = f"{name}_quickstart.png" if getattr(args, "testbed", "char") == "quickstart" \
        else f"{name}.png"
    # the figure only from the results, and those results committed beside it (redraw.py)
    redraw.draw(name, results, args.out / png, args.results_dir, plot)
    print(f"wrote {args.out / 'results.json'} and {png} in {results['seconds']} s")


class PassAtKProbe(Probe):
    """`Probe` that also reports unbiased pass@k for every k ≤ n (`pass_at_K` keys)."""

    progress = False

    def __call__(self, model: Any) -> dict[str, float]:
        summary, _ = self.evaluate(model)
        return {**self.row(summary),
                **{f"pass_at_{k}": float(v) for k, v in summary["pass_at_k"].items()}}
