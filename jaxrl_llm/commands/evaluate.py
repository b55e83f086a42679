"""`jaxrl-llm evaluate --model (checkpoint|HF dir) --task T --n N`: sample N completions per test
question, grade them and write pass@k, pass@1 ± SE, maj@K and the invalid rate to `eval.json`
(`eval.evaluate`)."""

from __future__ import annotations

import argparse

from jaxrl_llm.commands.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF directory or training checkpoint (run dir / checkpoints dir / "
                             "step dir); default: the config's model")
    parser.add_argument("--task", default=None, help="task name (default data.task)")
    parser.add_argument("--n", type=int, default=None, help="samples per question (eval.n)")
    parser.add_argument("--num-questions", type=int, default=None, help="eval.num_questions")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory override")
    parser.add_argument("--out", default=None, help="output directory (default RUN_DIR/eval)")
    parser.add_argument("--label", default=None, help="name of this evaluation in reports")
    parser.add_argument("--verifier", default=None,
                        help="generative verifier (HF dir or checkpoint): adds weighted "
                             "self-consistency (TOPR §4.4)")
    parser.add_argument("--verifications", type=int, default=None,
                        help="verifications per solution (eval.verifications)")
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.commands.config import load_experiment_config
    from jaxrl_llm.core.paths import as_path
    from jaxrl_llm.envs.sampled import runner_for
    from jaxrl_llm.eval.during_training import eval_task
    from jaxrl_llm.eval.evaluate import evaluate_model, write_eval
    from jaxrl_llm.policy.opener import open_model

    overrides = list(args.overrides)
    if args.task is not None:
        overrides.append(f"data.task={args.task}")
    if args.n is not None:
        overrides.append(f"eval.n={args.n}")
    if args.num_questions is not None:
        overrides.append(f"eval.num_questions={args.num_questions}")
    config = load_experiment_config(args.config, overrides)
    e, g = config.eval, config.generate
    opened = open_model(args.model, config, tokenizer=args.tokenizer, key="--model")
    model, tokenizer, info = opened.model, opened.tokenizer, opened.info
    task = eval_task(config)  # data.task, from eval.task_path when set
    problems = task.load(split=e.split, num=e.num_questions, seed=config.seed)
    temperature = g.temperature if e.temperature is None else e.temperature
    verifier = None
    if args.verifier is not None:
        judge = open_model(args.verifier, config, key="--model")
        verifier = (judge.model, judge.tokenizer)
    summary, graded = evaluate_model(
        model, tokenizer, task, problems, n=e.n, temperature=temperature,
        max_new_tokens=e.max_new_tokens or g.max_new_tokens,
        batch_size=e.batch_size or g.batch_size, seed=e.seed, maj_k=e.maj_k,
        trials=e.bootstrap_trials, verifier=verifier,
        verifications=args.verifications or e.verifications, chat_template=config.data.chat_template,
        sampler=config.generate.sampler_options(),
        runner=runner_for(config, task, tokenizer, max_new_tokens=e.max_new_tokens),
    )
    summary.update(info, split=e.split, label=args.label or as_path(info["model"]).name)
    out = write_eval(args.out or as_path(config.run_dir) / "eval", summary, graded, problems)
    p1 = summary["pass_at_1"]
    print(f"{summary['label']}: pass@1 {p1['mean']:.3f} ± {p1['se']:.3f} (SE), "  # type: ignore[index]
          f"invalid {summary['proportions']['invalid']:.3f}; wrote {out}")  # type: ignore[index]
    return 0
