"""Multi-turn tool use on the quickstart testbed: does RL teach the small policy to use the
calculator? Test pass@1 and tool calls per episode per iteration, against the same RL without
the tool, 3 seeds, mean ± SE.

The testbed is the quickstart's (a random 4-layer, 128-wide Llama on a byte-level BPE
tokenizer trained on the task's text, SFT warm start on gold solutions, then TOPR iterations
of `jaxrl-llm iterate`), on arithmetic it cannot do in its head: two operations on operands up
to 99 (products of two-digit numbers, four-digit answers). Its prompt is the `calculator`
environment's (docs/environments.md: the task's question with the tool listed in the system
turn, plain text: `data.chat_template: false`), and its SFT gold episodes are a mix: a
fraction `tool_fraction` call the calculator with the question's expression, read the result
and answer with it (a multi-turn episode, two model turns); the rest work it out step by step
with no call. So the warm policy π_0 knows the tool-call format but calls it only about that
often. Gold episodes are made by the environment's own `EpisodeRunner` with scripted model
turns, so their tokens are the ones sampled episodes have (the observation rendered by the
same `TurnRenderer`), and the SFT loss reads model tokens only (the records' action mask).

Arms, per seed, from the same π_0, each one `jaxrl-llm iterate` run (TOPR, c = −0.3):

- `calculator`: `env: {name: calculator}`: every sample is an episode, the tool answers;
- `no_tool`: the same prompt token for token (`data.system_prompt` = the environment's system
  turn with the tool listed), single-turn: a tool call is never answered, so such a sample
  ends without an answer (invalid, −1). The same RL without the tool.

Each iteration's evaluation (test questions, fixed sampling seed) gives pass@1 and, for the
calculator arm, tool calls per episode; each iteration's samples (from π_{i−1}, on training
prompts) give the tool-use rate and the accuracy of episodes with and without a tool call.

    python experiments/tool_use.py --out runs/experiments/tool_use [--smoke]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from experiments import aggregate, common, iterated

CONFIG = Path(__file__).with_name("tool_use.yaml")
GOLD_SEED = 7  # problem seed of the SFT gold episodes (test questions use each run's seed)
ARMS = ("calculator", "no_tool")


def tool_call_text(problem: Any) -> str:
    """The gold call: the question's expression, in the Hermes format the parser reads."""
    expression = problem.question.removeprefix("What is ").removesuffix("?")
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def answer_text(value: str) -> str:
    from jaxrl_llm.tasks.answers import MAGIC

    return f"{MAGIC} {value}."


def prompt_text(env: Any, problem: Any) -> str:
    """The episode's plain-text prompt (`TurnRenderer.prompt_ids` without a chat template)."""
    from jaxrl_llm.envs.render import hermes_system

    return f"{hermes_system(env.system_prompt(problem), env.tools())}\n\n{env.user_prompt(problem)}"


def tokenizer_texts(env: Any, problems: list[Any]) -> list[str]:
    """Text for the BPE tokenizer: each problem's prompt with both gold episodes."""
    from jaxrl_llm.envs.render import PLAIN_CUE

    texts = []
    for p in problems:
        prompt = prompt_text(env, p)
        texts.append(prompt + p.solution)
        texts.append(prompt + tool_call_text(p) + f"\ntool: {p.answer}\n{PLAIN_CUE}"
                     + answer_text(p.answer))
    return texts


def gold_episodes(runner: Any, problems: list[Any], tool: np.ndarray) -> list[Any]:
    """One record per problem, made by the runner from scripted model turns: a call, the
    tool's answer and the answer (tool[i]), or the step-by-step solution."""
    tok = runner.renderer.tokenizer
    encode = lambda text: tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    records = []
    for i, p in enumerate(problems):
        ep = runner.begin(p)
        if tool[i]:
            ids = encode(tool_call_text(p))
            if runner.submit(ep, ids, [0.0] * len(ids), True).result() is None:
                raise RuntimeError(f"gold episode {p.id}: the calculator did not answer the call "
                                   f"({ep.truncated}, {ep.turns[-1]})")
            result = ep.turns[-1]["messages"][0]["content"]  # the tool's answer
            ids = encode(answer_text(result))
        else:
            ids = encode(p.solution)
        if runner.submit(ep, ids, [0.0] * len(ids), True).result() is not None:
            raise RuntimeError(f"gold episode {p.id}: the environment did not end it")
        record = runner.finish(ep, group_id=i)
        if not record.correct:
            raise RuntimeError(f"gold episode {p.id} is not correct: {record.completion_text!r}")
        records.append(record)
    return records


def warm_policy(cache: Path, cfg: dict[str, Any], *, smoke: bool) -> dict[str, Any]:
    """Tokenizer, gold episodes, SFT (`sft_warm_start`), export; then π_0's pass@1 with and
    without the tool on the test questions (`jaxrl-llm evaluate`). Built once into `cache`."""
    from tokenizers import AddedToken

    from jaxrl_llm.data.shards import write_records
    from jaxrl_llm.envs.calculator import CalculatorEnv
    from jaxrl_llm.envs.episodes import EpisodeRunner
    from jaxrl_llm.envs.render import TurnRenderer
    from jaxrl_llm.models.tokenizer import train_bpe_tokenizer
    from jaxrl_llm.tasks.arithmetic import ArithmeticTask

    cache = cache.resolve()
    info_path = cache / "warm.json"
    if info_path.exists():
        return {**json.loads(info_path.read_text()), "model": str(cache / "models" / "sft")}
    t0 = time.perf_counter()
    s = cfg["sft"]
    task = ArithmeticTask(**cfg["task_options"])
    env = CalculatorEnv(task=task)
    problems = task.load(split="train", num=s["gold_prompts"], seed=GOLD_SEED)
    tok_dir = cache / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        # numbers whole (not split into digits): a call copies the question's numbers and
        # the answer the tool's, and a 4-layer model copies a number it can find by its one
        # token far more easily than a run of digits that recur across the expression
        bpe = train_bpe_tokenizer(tokenizer_texts(env, problems[:2000]),
                                  cfg["tokenizer_vocab_size"], split_digits=False)
        # one token for the environment's fixed system turn (its instructions and the tool's
        # JSON schema, ≈ 230 BPE tokens, the same in every prompt): the model reads the same
        # text, and sequences stay at the quickstart's length on a 2-core CPU
        bpe.add_tokens([AddedToken(no_tool_system(), normalized=False, special=False)])
        bpe.save_pretrained(str(tok_dir))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    runner = EpisodeRunner(env, TurnRenderer(tok, chat_template=False, tools=env.tools()),
                           max_turns=cfg["max_turns"], max_episode_tokens=cfg["max_new_tokens"],
                           timeout_s=30, workers=4)
    from jaxrl_llm.generate.completions import encode_prompts, format_prompts
    from jaxrl_llm.tasks.base import with_system_prompt

    # the no_tool arm's single-turn prompt is the episode's, token for token
    other = with_system_prompt(ArithmeticTask(**cfg["task_options"]), no_tool_system())
    plain = format_prompts(tok, [other.prompt(problems[0])])
    if encode_prompts(tok, plain)[0] != runner.begin(problems[0]).prompt_ids:
        raise RuntimeError("the single-turn prompt differs from the calculator episode's")
    tool = np.random.default_rng(GOLD_SEED).random(len(problems)) < cfg["tool_fraction"]
    records = gold_episodes(runner, problems, tool)
    write_records(cache / "gold", records, overwrite=True, task=task.name,
                  reward_fn=task.reward_fn, vocab_size=len(tok), extra={"source": "gold"})
    longest = max(r.prompt_ids.size + r.completion_ids.size for r in records)
    # positions: the longest prompt (of these and of the test questions) + the episode budget
    prompts = [len(runner.begin(p).prompt_ids) for p in problems + task.load(
        split="test", num=cfg["eval_questions"], seed=0)]
    cfg = {**cfg, "max_seq_len": -(-(max(prompts) + cfg["max_new_tokens"]) // 16) * 16}
    sft_config = common.write_config(cache / "sft.yaml", experiment_config(
        cfg, model=model_section(cfg, len(tok)), tokenizer=str(tok_dir), seed=0,
        run_dir=str(cache / "sft"), arm="calculator",
        loss={"name": "sft"}, optim={"learning_rate": s["learning_rate"], "schedule": "constant"},
        train={"steps": s["steps"], "batch_size": s["batch_size"], "log_every": 50,
               "checkpoint_every": s["steps"], "eval_every": s["eval_every"]}))
    probe = sft_warm_start(sft_config, cache, task, tok, runner, s)
    info = {"model": str(cache / "models" / "sft"), "tokenizer": str(tok_dir),
            "vocab_size": len(tok), "smoke": smoke, "gold_episodes": len(records),
            "gold_tool_episodes": int(tool.sum()), "gold_longest_tokens": int(longest),
            "prompt_tokens": [int(min(prompts)), int(max(prompts))],
            "max_seq_len": cfg["max_seq_len"], "sft_probe": probe,
            "sft_steps": probe[-1]["step"]}
    for arm in ARMS:  # π_0 with and without the tool, on the arms' test questions
        config = common.write_config(cache / f"eval_{arm}.yaml", experiment_config(
            cfg, model={"source": "hf", "path": info["model"]}, tokenizer=None, seed=0,
            run_dir=str(cache / f"eval_{arm}"), arm=arm))
        common.jaxrl("evaluate", "--config", str(config), "--model", info["model"],
                     "--out", str(cache / f"eval_{arm}"))
        info[f"pi0_{arm}"] = eval_row(json.loads((cache / f"eval_{arm}" / "eval.json")
                                                 .read_text()))
    info["seconds"] = round(time.perf_counter() - t0, 1)
    info_path.write_text(json.dumps(info, indent=2))
    return info


def sft_warm_start(config_path: Path, cache: Path, task: Any, tok: Any, runner: Any,
                   s: dict[str, Any]) -> list[dict[str, Any]]:
    """SFT on the gold episodes (the public `Trainer`, as the quickstart's warm start), probing
    pass@1 and tool calls per episode on validation questions every `eval_every` steps and
    stopping once pass@1 reaches `target_pass_at_1`; the model exported with its tokenizer
    into cache/models/sft. Returns the probe rows."""
    from jaxrl_llm.config import load_config
    from jaxrl_llm.eval.evaluate import evaluate_model
    from jaxrl_llm.policy.export import atomic_save
    from jaxrl_llm.train.trainer import Trainer

    config = load_config(config_path, [])
    problems = task.load(split="validation", num=s["eval_questions"], seed=common.VALIDATION_SEED)
    rows: list[dict[str, Any]] = []
    trainer: Any = None

    def hook(step: int, state: Any) -> dict[str, float]:
        summary, _ = evaluate_model(state.model(), tok, task, problems, n=s["eval_n"],
                                    temperature=1.0, max_new_tokens=runner.max_episode_tokens,
                                    batch_size=64, seed=1234, maj_k=(1,), trials=2,
                                    progress=False, runner=runner)
        row = {"step": step, **eval_row(summary)}
        rows.append(row)
        print(f"[sft] step {step}: pass@1 {row['pass_at_1']:.3f}, "
              f"{row['tool_calls_per_episode']:.2f} tool calls per episode", flush=True)
        if row["pass_at_1"] >= s["target_pass_at_1"] and trainer is not None:
            trainer.request_stop()
        return {"pass_at_1": row["pass_at_1"], "tool_calls": row["tool_calls_per_episode"]}

    trainer = Trainer(config, records=str(cache / "gold"), eval_hook=hook, progress=False,
                      tensorboard=False)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    reached = bool(rows) and rows[-1]["pass_at_1"] >= s["target_pass_at_1"]
    if result.stopped and not reached:  # a signal, not the target: never a partial warm start
        raise RuntimeError(f"SFT stopped at step {result.step} before its target; re-run")
    if not rows or rows[-1]["step"] != result.step:  # the last step, probed
        hook(result.step, result.state)
    atomic_save(result.state.model(), cache / "models" / "sft", tokenizer=tok, overwrite=True)
    return rows


def no_tool_system() -> str:
    """The calculator episode's system turn (instructions, the tool listed), as text."""
    from jaxrl_llm.envs.calculator import CalculatorEnv
    from jaxrl_llm.envs.render import hermes_system

    env = CalculatorEnv(task=None)
    return hermes_system(env.instructions, env.tools())


def model_section(cfg: dict[str, Any], vocab: int) -> dict[str, Any]:
    return {"source": "random", "vocab_size": vocab, **cfg["model"],
            "max_position_embeddings": cfg["max_seq_len"]}


def experiment_config(cfg: dict[str, Any], *, model: dict[str, Any], tokenizer: str | None,
                      seed: int, run_dir: str, arm: str, **sections: dict[str, Any]) -> dict:
    """The config of one run (SFT, an evaluation or an arm's `iterate`) on this testbed."""
    data: dict[str, Any] = {"task": "arithmetic", "task_options": cfg["task_options"],
                            "chat_template": False, "num_prompts": cfg["num_prompts"],
                            "shuffle_seed": seed}
    if tokenizer is not None:
        data["tokenizer"] = tokenizer
    env: dict[str, Any] = {}
    if arm == "calculator":
        env = {"name": "calculator", "max_turns": cfg["max_turns"]}
    else:  # the calculator's prompt, token for token; nothing answers a call
        data["system_prompt"] = no_tool_system()
    config = common.base_config(
        model, seed=seed, run_dir=run_dir,
        optim={"learning_rate": cfg["learning_rate"], "schedule": "constant"},
        train={"steps": cfg["steps"], "batch_size": cfg["batch_size"],
               "max_seq_len": cfg["max_seq_len"], "log_every": cfg["steps"],
               "checkpoint_every": cfg["steps"], "keep_checkpoints": 1},
        generate={"n": cfg["n"], "max_new_tokens": cfg["max_new_tokens"], "batch_size": 64,
                  "score_batch_size": 32},
        data=data,
        eval={"n": cfg["eval_n"], "num_questions": cfg["eval_questions"], "batch_size": 64,
              "maj_k": [1], "bootstrap_trials": 2})
    config.pop("env", None)
    if env:
        config["env"] = env
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def eval_row(summary: dict[str, Any]) -> dict[str, Any]:
    episodes = summary.get("episodes") or {}
    return {"pass_at_1": summary["pass_at_1"]["mean"], "pass_at_1_se": summary["pass_at_1"]["se"],
            "invalid": summary["proportions"]["invalid"],
            "tool_calls_per_episode": episodes.get("tool_calls_per_episode", 0.0),
            "turns_per_episode": episodes.get("turns_per_episode", 1.0),
            "tool_errors_per_episode": episodes.get("tool_errors_per_episode", 0.0)}


def sample_row(directory: Path) -> dict[str, Any]:
    """An iteration's generated records: tool-use rate and accuracy with and without a call."""
    from jaxrl_llm.data.shards import RecordSource

    source = RecordSource(directory)
    calls, correct = [], []
    for i in range(len(source)):
        record = source[i]
        episode = record.metadata.get("episode") or {}
        calls.append(int(episode.get("tool_calls", 0)))
        correct.append(bool(record.correct))
    calls_a, correct_a = np.asarray(calls), np.asarray(correct)
    used = calls_a > 0
    return {"episodes": int(calls_a.size), "tool_use_rate": float(used.mean()),
            "tool_calls_per_episode": float(calls_a.mean()), "accuracy": float(correct_a.mean()),
            "with_tool": int(used.sum()), "correct_with_tool": int(correct_a[used].sum()),
            "correct_without_tool": int(correct_a[~used].sum())}


def pooled_accuracy(samples: list[list[dict[str, Any]]]) -> dict[str, dict[str, list]]:
    """Per policy π_i (its samples in iteration i + 1), over every seed's samples: the accuracy
    of episodes with a tool call and of those without, at the policies that had some."""
    out: dict[str, dict[str, list]] = {k: {"policy": [], "accuracy": []}
                                       for k in ("with_tool", "without_tool")}
    for i, rows in enumerate(zip(*samples, strict=True)):
        counts = {"with_tool": (sum(r["correct_with_tool"] for r in rows),
                                sum(r["with_tool"] for r in rows)),
                  "without_tool": (sum(r["correct_without_tool"] for r in rows),
                                   sum(r["episodes"] - r["with_tool"] for r in rows))}
        for key, (correct, episodes) in counts.items():
            if episodes:
                out[key]["policy"].append(i)
                out[key]["accuracy"].append(correct / episodes)
    return out


def run_arm(out: Path, warm: dict[str, Any], cfg: dict[str, Any], arm: str, seed: int
            ) -> dict[str, Any]:
    cfg = {**cfg, "max_seq_len": warm["max_seq_len"]}
    run_dir = out / "runs" / f"{arm}-seed{seed}"
    config = common.write_config(out / "configs" / f"{arm}-seed{seed}.yaml", experiment_config(
        cfg, model={"source": "hf", "path": warm["model"]}, tokenizer=None, seed=seed,
        run_dir=str(run_dir), arm=arm,
        loss={"name": "topr", "baseline": cfg["baseline"]},
        iterate={"iterations": cfg["iterations"], "export": False, "evaluate_initial": True}))
    t0 = time.perf_counter()
    iterated.run_iterate(config, run_dir)
    evals = iterated.evaluations(run_dir, cfg["iterations"], first=0)
    samples = [sample_row(Path(iterated.stages(run_dir, i)["generate"]["records"]))
               for i in range(1, cfg["iterations"] + 1)]
    return {"rows": [eval_row(e) for e in evals], "samples": samples,
            "seconds": round(time.perf_counter() - t0, 1)}


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    warm = warm_policy(args.cache, cfg, smoke=args.smoke)
    print(f"[π_0] with the tool: pass@1 {warm['pi0_calculator']['pass_at_1']:.3f}, "
          f"{warm['pi0_calculator']['tool_calls_per_episode']:.2f} calls per episode; "
          f"without: {warm['pi0_no_tool']['pass_at_1']:.3f}", flush=True)
    results: dict[str, Any] = {"config": cfg, "warm_policy": warm,
                               "arms": {a: {"runs": {}} for a in ARMS}}
    for seed in cfg["seeds"]:
        for arm in ARMS:
            entry = run_arm(args.out, warm, cfg, arm, seed)
            results["arms"][arm]["runs"][str(seed)] = entry
            print(f"[{arm} seed {seed}] pass@1 "
                  + " → ".join(f"{r['pass_at_1']:.3f}" for r in entry["rows"])
                  + "; tool calls per episode "
                  + " → ".join(f"{r['tool_calls_per_episode']:.2f}" for r in entry["rows"])
                  + f" ({entry['seconds']} s)", flush=True)
    for entry in results["arms"].values():
        runs = [entry["runs"][str(s)]["rows"] for s in cfg["seeds"]]
        entry["iteration"] = list(range(cfg["iterations"] + 1))
        for key in ("pass_at_1", "invalid", "tool_calls_per_episode"):
            entry[key] = aggregate.over_seeds(runs, key)
        samples = [entry["runs"][str(s)]["samples"] for s in cfg["seeds"]]
        entry["samples_policy"] = list(range(cfg["iterations"]))  # π_i sampled iteration i + 1
        for key in ("tool_use_rate", "accuracy"):
            entry[f"samples_{key}"] = aggregate.over_seeds(samples, key)
        entry["samples_pooled_accuracy"] = pooled_accuracy(samples)
    final = {a: [results["arms"][a]["runs"][str(s)]["rows"][-1]["pass_at_1"]
                 for s in cfg["seeds"]] for a in ARMS}
    diff = np.subtract(final["calculator"], final["no_tool"])
    results["final_difference"] = aggregate.mean_and_se(diff)
    return results


def plot(results: dict[str, Any], path: Path) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from experiments import redraw

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    seeds = next(iter(results["arms"].values()))["runs"].keys()
    labels = {"calculator": "with the calculator (env: calculator)",
              "no_tool": "without (single-turn, same prompt)"}
    for arm, entry in results["arms"].items():
        x = np.array(entry["iteration"])
        for ax, key in zip(axes[:2], ("pass_at_1", "tool_calls_per_episode"), strict=True):
            m, se = np.array(entry[key]["mean"]), np.array(entry[key]["se"])
            ax.errorbar(x, m, yerr=se, marker="o", capsize=3, label=labels[arm])
        if arm == "calculator":
            m, se = (np.array(entry["samples_tool_use_rate"][k]) for k in ("mean", "se"))
            axes[2].errorbar(entry["samples_policy"], m, yerr=se, marker="o", capsize=3,
                             label="episodes with a call (mean ± SE)")
            for key, name in (("with_tool", "accuracy of those (pooled)"),
                              ("without_tool", "accuracy of the others (pooled)")):
                pooled = entry["samples_pooled_accuracy"][key]
                axes[2].plot(pooled["policy"], pooled["accuracy"], marker="s", ls="--",
                             label=name)
    n = redraw.seed_label(seeds)
    axes[0].set(xlabel="iteration", ylabel="test pass@1", title=f"accuracy (mean ± SE, {n})")
    axes[1].set(xlabel="iteration", ylabel="tool calls per episode",
                title="calculator calls (test episodes)")
    axes[2].set(xlabel="policy π_i (its samples in iteration i + 1)", ylabel="share",
                title="training samples, calculator arm")
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations and policies
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("RL teaches the quickstart policy to use the calculator (TOPR, iterate)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def add_seeds_arg(parser: Any) -> None:
    # a cut run is finished by re-running with the seeds it completed (each arm's run_dir is
    # reused: iterate skips the stages it completed)
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run only these of the section's seeds")


def main() -> None:
    common.run_experiment(__doc__, "tool_use", CONFIG, run, plot, cache_name="warm_policy_tool_use",
                          extra=add_seeds_arg)


if __name__ == "__main__":
    main()
