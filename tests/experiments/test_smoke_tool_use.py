"""experiments/tool_use.py with `--smoke`, as a user runs it (a subprocess from a temporary
directory): the PNG and the JSON exist, every number is finite, both arms have a row per
iteration (plus π_0) for every seed, the single-turn arm never gets a tool call answered, and
the SFT gold episodes are what the experiment says: the tool ones a call, the calculator's
result (environment tokens, action mask 0) and the answer read from it; the others one
step-by-step turn. The scientific outcome is measured in experiments/README.md."""

from __future__ import annotations

import json

import pytest

from tests.experiments.test_smoke_iterated import run_smoke, smoke_config


@pytest.mark.slow  # SFT, two evaluations and two iterate runs of a tiny model
def test_tool_use_smoke(tmp_path):
    from transformers import AutoTokenizer

    from jaxrl_llm.data.shards import RecordSource
    from jaxrl_llm.tasks.arithmetic import ArithmeticTask

    cache = tmp_path / "cache"
    out, results = run_smoke("tool_use.py", tmp_path, cache)
    cfg = smoke_config("tool_use")
    iterations = list(range(cfg["iterations"] + 1))
    seeds = [str(s) for s in cfg["seeds"]]
    assert list(results["arms"]) == ["calculator", "no_tool"]
    for name, entry in results["arms"].items():
        assert entry["iteration"] == iterations and sorted(entry["runs"]) == seeds
        for key in ("pass_at_1", "tool_calls_per_episode"):
            assert len(entry[key]["mean"]) == len(iterations), (name, key)
        for seed in seeds:
            run = entry["runs"][seed]
            assert len(run["rows"]) == len(iterations)
            assert len(run["samples"]) == cfg["iterations"]
            assert all(s["episodes"] == cfg["num_prompts"] * cfg["n"] for s in run["samples"])
    # single-turn: nothing answers a call, so no episode has a tool call or a second turn
    for row in results["arms"]["no_tool"]["runs"][seeds[0]]["rows"]:
        assert row["tool_calls_per_episode"] == 0.0 and row["turns_per_episode"] == 1.0

    warm = results["warm_policy"]
    tok = AutoTokenizer.from_pretrained(warm["tokenizer"])
    problems = {p.id: p for p in ArithmeticTask(**cfg["task_options"]).load(
        split="train", num=cfg["sft"]["gold_prompts"], seed=7)}
    gold = RecordSource(cache / "gold")
    tools = 0
    for i in range(len(gold)):
        record = gold[i]
        problem = problems[record.metadata["problem_id"]]
        assert record.correct and record.reward == 1.0
        mask = record.action_mask
        env_text = tok.decode(record.completion_ids[mask == 0].tolist())
        model_text = tok.decode(record.completion_ids[mask == 1].tolist(),
                                skip_special_tokens=True)
        expression = problem.question.removeprefix("What is ").removesuffix("?")
        if record.metadata["episode"]["num_turns"] == 2:  # a call, its result, the answer
            tools += 1
            assert env_text == f"\ntool: {problem.answer}\nassistant: "
            call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
            assert model_text == (f"<tool_call>\n{call}\n</tool_call>"
                                  f"The answer is {problem.answer}.")
            assert record.metadata["episode"]["tool_calls"] == 1
        else:
            assert mask is None or mask.all()
            assert model_text == problem.solution
    assert tools == warm["gold_tool_episodes"] > 0
    assert (out / "tool_use.png").exists()
