"""`jaxrl-llm iterate --config X`: iterated off-policy RL (TOPR arXiv:2503.14286 §4.3; PKPO arXiv:2505.15201).

For i = 1..I, with π_0 the configured (or given) model:

    generate with π_{i−1} ─▶ reward ─▶ score μ_i = π_{i−1} ─▶ curate ─▶ train ─▶ checkpoint
        ─▶ export (HF) ─▶ evaluate

Each stage writes under `run_dir/iter_i/` (`records/`, `scored/`, `curated/`, `train/`,
`export/`, `eval/`) and is recorded in `iter_i/stages.json` when complete; a re-run skips
completed stages (and the trainer resumes a half-finished `train` from its checkpoint).
Iteration i samples a fresh slice of `data.num_prompts` prompts, so small iterations (a few
prompts, a few steps) give the online/iterated set-ups of TOPR on Countdown (RLOO + TOPR: set
`data.group_transform: rloo`) and PKPO (PKPO with k annealed: `iterate.pkpo_k`). The whole loop
runs in one process; the train step and the sampler compile once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from etils import epath
from pydantic import Field

from jaxrl_llm.config import ConfigError, ExperimentConfig, Section
from jaxrl_llm.core.atomic import atomic_write_text
from jaxrl_llm.core.paths import append_text, as_path
from jaxrl_llm.core.signals import Interrupted, signal_name
from jaxrl_llm.data.chunked import complete
from jaxrl_llm.data.curation import curate_directory
from jaxrl_llm.data.run_layout import (  # noqa: F401
    STAGES_FILE,
    StageLog,
    iteration_dir,
    policy_ready,
    prompt_offset,
    sampling_seed,
)
from jaxrl_llm.data.shards import RecordSource
from jaxrl_llm.data.stages import choose_input, needs_score
from jaxrl_llm.envs.sampled import runner_for
from jaxrl_llm.eval.evaluate import evaluate_model, write_eval
from jaxrl_llm.eval.metrics import SolveTracker, pass_at_k_per_question
from jaxrl_llm.generate.jax_backend import generate_records
from jaxrl_llm.generate.vllm_host import LocalHost, wait_for
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.policy.export import atomic_save
from jaxrl_llm.policy.opener import open_checkpoint, open_model, open_tokenizer
from jaxrl_llm.tasks import task_from_config
from jaxrl_llm.train.checkpoint import CHECKPOINT_DIR
from jaxrl_llm.train.metrics_log import truncate_after
from jaxrl_llm.train.score import score_records
from jaxrl_llm.train.trainer import Trainer

STAGES = ("generate", "score", "curate", "train", "export", "evaluate")


class IterateSection(Section):
    """The outer loop of `iterate` (and the RL part of `quickstart`)."""

    iterations: int = Field(1, gt=0)  # generate → score → curate → train → export → evaluate rounds
    # PKPO's k per iteration (PKPO §5.2.2 anneals k, e.g. [8, 8, 4, 1]); the last value
    # repeats. None = `data.pkpo_k` every iteration.
    pkpo_k: list[int] | None = None
    evaluate_initial: bool = True  # evaluate π_0 into iter_0/eval (the "before" numbers)
    export: bool = True  # export each iteration's policy (iter_i/export)
    evaluate: bool = True  # evaluate each iteration's policy (iter_i/eval)
    fresh_prompts: bool = True  # iteration i samples prompts [i·N, (i+1)·N) of the split
    # generate.backend: vllm — who runs the vLLM engine (generate/vllm_host.py): `local`, a
    # child process of iterate; `external`, `jaxrl-llm vllm host --config C` on another host
    # sharing run_dir. The trainer waits for each iteration's records (at most the timeout).
    vllm_host: Literal["local", "external"] = "local"
    vllm_wait_timeout_s: float | None = Field(
        None, gt=0, description="longest wait for the vLLM host's records (None: no limit)")


class IterateConfig(ExperimentConfig):
    """An experiment plus the `iterate:` section."""

    iterate: IterateSection = Field(default_factory=IterateSection)


def experiment_part(config: ExperimentConfig) -> ExperimentConfig:
    """The plain `ExperimentConfig` inside a subclass config (what checkpoints store)."""
    data = config.model_dump(include=set(ExperimentConfig.model_fields))
    return ExperimentConfig.model_validate(data)


@dataclass
class IterationResult:
    index: int
    directory: epath.Path
    model: Any
    eval: dict[str, Any] | None
    stages: dict[str, Any]


def _say(progress: bool, text: str) -> None:
    if progress:
        print(text, flush=True)


def evaluate_into(model: Any, tokenizer: Any, task: Any, config: ExperimentConfig,
                  out_dir: epath.Path, *, label: str, step: int | None = None) -> dict[str, Any]:
    """Evaluate `model` on the config's eval split and write `out_dir/eval.json`."""
    e, g = config.eval, config.generate
    problems = task.load(split=e.split, num=e.num_questions, seed=config.seed)
    summary, graded = evaluate_model(
        model, tokenizer, task, problems, n=e.n,
        temperature=g.temperature if e.temperature is None else e.temperature,
        max_new_tokens=e.max_new_tokens or g.max_new_tokens,
        batch_size=e.batch_size or g.batch_size, seed=e.seed, maj_k=e.maj_k,
        trials=e.bootstrap_trials, chat_template=config.data.chat_template,
        sampler=config.generate.sampler_options(),
        runner=runner_for(config, task, tokenizer, max_new_tokens=e.max_new_tokens),
    )
    summary["label"] = label
    if step is not None:
        summary["step"] = step
    write_eval(out_dir, summary, graded, problems)
    return summary


def record_sample_metrics(config: IterateConfig, index: int, records: epath.Path) -> dict[str, Any]:
    """Training-sample metrics of PKPO for iteration `index`: pass@k for every k ≤ n on the
    prompts just sampled, and the cumulative solve rate (fraction of the tasks seen so far
    solved at least once). Appended as one row to `run_dir/metrics.jsonl` (step = the
    global train step at the start of the iteration) and returned."""
    run_dir = as_path(config.run_dir)
    d = config.data
    source = RecordSource(str(records))
    groups = np.asarray([r.group_id for r in source])
    correct = np.asarray([r.correct for r in source], bool)
    ids, inverse = np.unique(groups, return_inverse=True)
    n_per = np.bincount(inverse)
    c_per = np.bincount(inverse, weights=correct).astype(np.int64)
    offset = (index - 1) * d.num_prompts if config.iterate.fresh_prompts else 0
    total_tasks = (config.iterate.iterations if config.iterate.fresh_prompts else 1) \
        * d.num_prompts
    state_path = run_dir / "solve_tracker.json"
    tracker = (SolveTracker.from_state_dict(json.loads(state_path.read_text()), total_tasks)
               if state_path.exists() else SolveTracker(total_tasks))
    rate = tracker.update((offset + ids).tolist(), (c_per > 0).tolist())
    atomic_write_text(state_path, json.dumps(tracker.state_dict()))
    row: dict[str, Any] = {"step": (index - 1) * config.train.steps,
                           "samples/cumulative_solve_rate": rate,
                           "samples/accuracy": float(correct.mean())}
    n = int(n_per.min())
    if n == int(n_per.max()):  # pass@k needs the same n for every prompt
        curve = pass_at_k_per_question(n, c_per).mean(axis=0)
        row.update({f"samples/pass_at_{k}": float(curve[k - 1]) for k in range(1, n + 1)})

    # A generate stage re-run after a kill replaces its row: no step is logged twice.
    truncate_after(run_dir / "metrics.jsonl", row["step"] - 1)
    append_text(run_dir / "metrics.jsonl", json.dumps(row) + "\n")
    return {k.split("/", 1)[1]: v for k, v in row.items() if k != "step"}


def previous_train_state(config: IterateConfig, index: int) -> epath.Path | None:
    """Iteration `index − 1`'s checkpoints, whose final train state (optimizer moments and
    step, RNG) iteration `index` continues; None for the first iteration (a fresh optimizer)."""
    if index <= 1:
        return None
    previous = as_path(config.run_dir) / f"iter_{index - 1}"
    if not StageLog(previous).done("train"):
        raise FileNotFoundError(f"iteration {index}: iteration {index - 1} has no finished "
                                f"train stage in {previous} to continue from")
    return previous / "train" / CHECKPOINT_DIR


def pkpo_k_for(config: IterateConfig, index: int) -> int | None:
    schedule = config.iterate.pkpo_k
    if not schedule:
        return config.data.pkpo_k
    return schedule[min(index - 1, len(schedule) - 1)]


def wait_for_vllm_records(config: IterateConfig, index: int, records: epath.Path, *,
                          host: Any | None, progress: bool) -> Any:
    """Iteration `index`'s records, written by the vLLM host (`generate/vllm_host.py`) from
    π_{index−1}'s export; refuses records sampled with other settings than the config's."""
    _say(progress, f"[iter {index}] waiting for the vLLM host's records in {records}")
    wait_for(lambda: complete(records) is not None, f"iteration {index}'s records ({records})",
             poll_seconds=1.0, timeout=config.iterate.vllm_wait_timeout_s, progress=progress,
             alive=host.check_alive if host is not None else None)
    manifest = complete(records)
    g, s = config.generate, manifest.sampling
    want = {"backend": "vllm", "n": g.n, "temperature": g.temperature, "top_p": g.top_p,
            "top_k": g.top_k, "max_new_tokens": g.max_new_tokens,
            "seed": sampling_seed(config, index)}
    differ = {k: (getattr(s, k), v) for k, v in want.items() if getattr(s, k) != v}
    if differ:
        raise ConfigError(f"{records}: sampled with {', '.join(f'{k}={a!r}' for k, (a, _) in differ.items())}"
                          f" but the config says {', '.join(f'{k}={b!r}' for k, (_, b) in differ.items())}; "
                          "delete the directory to sample it again")
    return manifest


def export_initial_policy(config: IterateConfig, model: Any, tokenizer: Any,
                          progress: bool) -> None:
    """π_0 as an HF directory for vLLM (`run_layout.policy_dir(config, 0)`), unless the
    configured model already is one."""
    if policy_ready(config, 0):
        return
    t0 = time.perf_counter()
    out = atomic_save(model, iteration_dir(config, 0) / "export", tokenizer=tokenizer,
                      overwrite=True)
    StageLog(iteration_dir(config, 0)).mark("export", {"path": str(out),
                                                       "seconds": time.perf_counter() - t0})
    _say(progress, f"[iter 0] exported π_0 for vLLM to {out}")


def run_iteration(
    config: IterateConfig, index: int, model: Any, tokenizer: Any, task: Any, *,
    progress: bool = True, mesh: Any | None = None, vllm_host: Any | None = None,
) -> IterationResult:
    """One iteration with π_{i−1} = `model`; completed stages are skipped."""
    g, d = config.generate, config.data
    it_dir = as_path(config.run_dir) / f"iter_{index}"
    log = StageLog(it_dir)
    records, scored, curated = it_dir / "records", it_dir / "scored", it_dir / "curated"

    if not log.done("generate"):
        t0 = time.perf_counter()
        offset = prompt_offset(config, index)
        if g.backend == "vllm":
            manifest = wait_for_vllm_records(config, index, records, host=vllm_host,
                                             progress=progress)
        else:
            problems = task.load(split=g.split, num=offset + d.num_prompts, seed=config.seed)
            manifest = generate_records(
                model, tokenizer, task, problems[offset:], str(records), n=g.n,
                temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                max_new_tokens=g.max_new_tokens, batch_size=g.batch_size,
                seed=sampling_seed(config, index), stop_at_eos=g.stop_at_eos,
                model_name=f"iter_{index - 1}", overwrite=True, progress=progress,
                chat_template=d.chat_template, sampler=config.generate.sampler_options(),
                runner=runner_for(config, task, tokenizer),
            )
        sample_stats = record_sample_metrics(config, index, records)
        log.mark("generate", {"records": str(records), "num_records": manifest.num_records,
                              "num_correct": manifest.num_correct,
                              "num_invalid": manifest.num_invalid, **sample_stats,
                              "backend": g.backend, "seconds": time.perf_counter() - t0})
        _say(progress, f"[iter {index}] generated {manifest.num_records} records "
                       f"({manifest.num_correct} correct, {manifest.num_invalid} invalid)")

    # Score when the loss reads μ or π_ref from the records (losses/registry.py).
    needs_mu = needs_score(config)
    if not log.done("score"):
        t0 = time.perf_counter()
        info: dict[str, Any] = {"skipped": True}
        if needs_mu:
            # The trainer's mesh (the Trainer below builds the same one when `mesh` is None).
            info = score_records(model, str(records), str(scored), temperature=None,
                                 batch_size=g.score_batch_size,
                                 chunk_size=config.loss.logprob_chunk_size,
                                 model_name=f"iter_{index - 1}", progress=progress,
                                 mesh=mesh if mesh is not None else make_mesh(config.mesh))
        log.mark("score", {**info, "seconds": time.perf_counter() - t0})
    # The stage chain's rule (data/stages.py): curate reads the scored records when written.
    source = choose_input("curate", records=str(records), scored=str(scored) if needs_mu else None)

    if not log.done("curate"):
        t0 = time.perf_counter()
        try:
            comp = curate_directory(
                str(source), str(curated), strategy=d.curation, num=d.num_records,
                seed=d.shuffle_seed + index, target=d.target_positive_fraction,
                power=d.hard_power, transform=d.group_transform,
                pkpo_k=pkpo_k_for(config, index), baseline=config.loss.baseline,
                overwrite=True,
            )
        except ValueError as err:
            raise ConfigError(f"data.curation={d.curation!r} (iteration {index}): {err}") from err
        log.mark("curate", {**comp.to_dict(), "seconds": time.perf_counter() - t0})
        _say(progress, f"[iter {index}] curated: {json.dumps(comp.to_dict())}")

    train_dir = it_dir / "train"
    if not log.done("train"):
        t0 = time.perf_counter()
        trainer = Trainer(experiment_part(config), records=curated, run_dir=train_dir,
                          model=model, mesh=mesh, progress=progress,
                          init_from=previous_train_state(config, index))
        try:
            result = trainer.run()
        finally:
            trainer.close()
        if result.stopped:
            raise Interrupted(f"iteration {index}: training stopped by "
                              f"{signal_name(result.stop_signal)} at step {result.step}; "
                              "re-run to resume", result.stop_signal)
        new_model = result.state.model()
        log.mark("train", {"steps": result.step, "checkpoints": str(result.checkpoint_dir),
                           "metrics": str(result.metrics_path), "last": result.last_row,
                           "seconds": time.perf_counter() - t0})
    else:
        new_model = open_checkpoint(str(train_dir), with_tokenizer=False).model

    if config.iterate.export and not log.done("export"):
        t0 = time.perf_counter()
        out = atomic_save(new_model, it_dir / "export", tokenizer=tokenizer, overwrite=True)
        log.mark("export", {"path": str(out), "seconds": time.perf_counter() - t0})

    summary = None
    if config.iterate.evaluate:
        eval_dir = it_dir / "eval"
        if not log.done("evaluate"):
            t0 = time.perf_counter()
            summary = evaluate_into(new_model, tokenizer, task, config, eval_dir,
                                    label=f"iter {index}", step=index * config.train.steps)
            log.mark("evaluate", {"path": str(eval_dir / "eval.json"),
                                  "pass_at_1": summary["pass_at_1"],
                                  "seconds": time.perf_counter() - t0})
        else:
            summary = json.loads((eval_dir / "eval.json").read_text())
    return IterationResult(index, it_dir, new_model, summary, log.stages)


def run_iterations(
    config: IterateConfig, *, model: Any | None = None, tokenizer: Any | None = None,
    progress: bool = True, mesh: Any | None = None,
    on_iteration: Callable[[IterationResult], None] | None = None,
) -> tuple[dict[str, Any] | None, list[IterationResult]]:
    """(initial eval or None, one result per iteration). `model`/`tokenizer` default to the
    config's; a re-run continues from the last completed iteration's checkpoint."""
    task = task_from_config(config)
    if tokenizer is None:
        tokenizer = open_tokenizer(config)
    run_dir = as_path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.json",
                      json.dumps(config.model_dump(mode="json"), indent=2))

    def initial_model() -> Any:
        return model if model is not None else open_model(None, config).model

    current = None
    host = None
    if config.generate.backend == "vllm":
        current = initial_model()
        export_initial_policy(config, current, tokenizer, progress)
        pending = [i for i in range(1, config.iterate.iterations + 1)
                   if complete(run_dir / f"iter_{i}" / "records") is None]
        if pending and config.iterate.vllm_host == "local":
            host = LocalHost(str(run_dir / "config.json"), str(run_dir))
            _say(progress, f"started the vLLM host (pid {host.process.pid}; log {host.log_path})")
    try:
        return _iterate(config, run_dir, task, tokenizer, current, initial_model, progress,
                        mesh, on_iteration, host)
    finally:
        if host is not None:
            host.stop()


def _iterate(config: IterateConfig, run_dir: epath.Path, task: Any, tokenizer: Any,
             current: Any, initial_model: Callable[[], Any], progress: bool, mesh: Any,
             on_iteration: Callable[[IterationResult], None] | None,
             host: Any) -> tuple[dict[str, Any] | None, list[IterationResult]]:
    initial = None
    if config.iterate.evaluate_initial:
        log = StageLog(run_dir / "iter_0")
        if log.done("evaluate"):
            initial = json.loads((run_dir / "iter_0" / "eval" / "eval.json").read_text())
        else:
            current = initial_model()
            initial = evaluate_into(current, tokenizer, task, config, run_dir / "iter_0" / "eval",
                                    label="initial", step=0)
            log.mark("evaluate", {"pass_at_1": initial["pass_at_1"]})
    results = []
    for index in range(1, config.iterate.iterations + 1):
        if current is None:
            previous = run_dir / f"iter_{index - 1}" / "train"
            if index > 1 and StageLog(run_dir / f"iter_{index - 1}").done("train"):
                current = open_checkpoint(str(previous), with_tokenizer=False).model
            else:
                current = initial_model()
        result = run_iteration(config, index, current, tokenizer, task, progress=progress,
                               mesh=mesh, vllm_host=host)
        results.append(result)
        if on_iteration is not None:
            on_iteration(result)
        current = result.model
    return initial, results
