"""Multi-turn episodes as records: `action_mask` in the schema (version 3, versions 1 and 2
still read), its validation naming the record and field, collation (environment tokens are
context: `loss_mask` 0, log-probs 0, padded and packed), `jaxrl-llm data show` rendering the
turns, `data stats` counting turns and tool calls, and PKPO over episode rewards (`curate`)."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from jaxrl_llm.cli import main
from jaxrl_llm.data.collate import collate, collate_packed, record_row
from jaxrl_llm.data.curation import curate_directory
from jaxrl_llm.data.records import Record, RecordError, validate_record
from jaxrl_llm.data.shards import read_records, write_records
from tests.losses.test_pkpo import bf_sloo_minus_one

ACTION = np.asarray([1, 1, 1, 0, 0, 1, 1], np.uint8)  # model 3, tool result 2, model 2


def episode(**changes) -> Record:
    lp = np.where(ACTION == 1, -np.arange(1, 8) / 4, 0.0).astype(np.float32)
    record = Record(
        prompt_ids=[5, 6, 7], completion_ids=[11, 12, 13, 21, 22, 14, 15], reward=1.0,
        correct=True, group_id=3, task="calc", behavior_logprobs=lp, raw_logprobs=lp,
        action_mask=ACTION, prompt_text="What is 2+3?", completion_text="<full text>",
        metadata={"episode": {  # as envs.episodes.EpisodeRunner.finish writes it
            "turns": [
                {"kind": "model", "start": 0, "end": 3, "stop": "end_of_turn",
                 "text": '<tool_call>{"name": "calculator"}</tool_call>'},
                {"kind": "env", "start": 3, "end": 5,
                 "messages": [{"role": "tool", "name": "calculator", "content": "5"}],
                 "info": {"tool_calls": [{"name": "calculator", "arguments": {"expression": "2+3"},
                                          "result": "5"}], "tool_errors": 0},
                 "reward": 0.25},
                {"kind": "model", "start": 5, "end": 7, "stop": "stop",
                 "text": "The answer is 5."},
            ],
            "num_turns": 2, "tool_calls": 1, "truncated": None, "turn_rewards": [0.25]}},
    )
    return record.replace(**changes)


# -- schema ------------------------------------------------------------------------------------


def test_action_mask_round_trips_in_schema_version_3():
    r = episode()
    payload = msgpack.unpackb(r.to_bytes(), raw=False)
    assert payload["v"] == 4  # the current writer (version 4 added routing)
    assert payload["action_mask"] == ACTION.tobytes()  # one byte a token
    back = Record.from_bytes(r.to_bytes())
    assert back.action_mask.dtype == np.uint8
    np.testing.assert_array_equal(back.action_mask, ACTION)
    assert back.metadata == r.metadata and back.num_model_tokens == 5
    np.testing.assert_array_equal(back.model_tokens(), ACTION == 1)
    # a single-turn record: no mask, every completion token is the model's
    plain = Record([1], [2, 3], reward=0.0)
    assert msgpack.unpackb(plain.to_bytes(), raw=False)["action_mask"] is None
    assert Record.from_bytes(plain.to_bytes()).action_mask is None
    assert plain.num_model_tokens == 2 and plain.model_tokens().all()
    # bool and 0/1 integer masks are stored as uint8
    assert Record([1], [2, 3], reward=0.0, action_mask=[True, False]).action_mask.dtype == np.uint8


def test_versions_1_and_2_still_read_and_a_mask_needs_version_3():
    payload = msgpack.unpackb(episode().to_bytes(), raw=False)
    for version in (2, 1):
        old = {k: v for k, v in payload.items() if k not in ("action_mask", "routing")}
        if version == 1:
            del old["ref_logprobs"]
        old["v"] = version
        r = Record.from_bytes(msgpack.packb(old, use_bin_type=True), where="old[0]")
        assert r.action_mask is None and r.ref_logprobs is None
    payload["v"] = 2  # a version-2 writer never wrote a mask: refuse, naming the field
    with pytest.raises(RecordError, match=r"^old\[0\]: field 'action_mask' in a schema version 2"):
        Record.from_bytes(msgpack.packb(payload, use_bin_type=True), where="old[0]")
    payload["v"] = 5
    with pytest.raises(RecordError, match=r"^old\[0\]: schema version 5"):
        Record.from_bytes(msgpack.packb(payload, use_bin_type=True), where="old[0]")


@pytest.mark.parametrize(("mask", "message"), [
    ([1, 0, 1], r"field 'action_mask' has shape \(3,\), completion has 7 tokens"),
    ([1, 1, 2, 0, 0, 1, 1], r"field 'action_mask' holds 2 at token 2; expected 0/1"),
    ([1, 1, 0.5, 0, 0, 1, 1], r"field 'action_mask' holds 0.5 at token 2"),
    ([0] * 7, r"field 'action_mask' marks no model token \(all 7 completion tokens"),
    ([0, 1, 1, 0, 0, 1, 1], r"field 'action_mask' starts with an environment token"),
])
def test_validation_refuses_a_malformed_mask_naming_record_and_field(mask, message):
    validate_record(episode(), where="recs/x[4]", vocab_size=50)
    bad = episode(action_mask=mask, behavior_logprobs=None, raw_logprobs=None)
    with pytest.raises(RecordError, match=rf"^recs/x\[4\]: {message}"):
        validate_record(bad, where="recs/x[4]", vocab_size=50)


def test_validation_refuses_log_probs_at_environment_tokens():
    lp = episode().behavior_logprobs.copy()
    lp[3] = -0.5  # a sampler's log-prob of a tool result token
    with pytest.raises(RecordError, match=r"^w: field 'behavior_logprobs' holds -0.5 at "
                                          r"environment token 3 \(action_mask 0\)"):
        validate_record(episode(behavior_logprobs=lp), where="w")


def test_a_mask_bytes_cannot_hold_is_refused_when_serialised():
    for mask in ([1, -1, 1, 0, 0, 1, 1], [1, 256, 1, 0, 0, 1, 1], [1, 0.5, 1, 0, 0, 1, 1]):
        with pytest.raises(RecordError, match="field 'action_mask' must hold 0/1"):
            episode(action_mask=mask).to_bytes()
    # 2 fits a byte: stored as written, refused by the reader's validation
    back = Record.from_bytes(episode(action_mask=[1, 2, 1, 0, 0, 1, 1]).to_bytes())
    with pytest.raises(RecordError, match="holds 2 at token 1"):
        validate_record(back, where="r")


def test_shards_keep_the_mask_and_refuse_a_bad_one_naming_shard_and_index(tmp_path):
    records = [episode(group_id=i) for i in range(3)]
    write_records(tmp_path / "ok", records)
    np.testing.assert_array_equal(read_records(tmp_path / "ok")[2].action_mask, ACTION)
    records[2] = episode(action_mask=np.zeros(7, np.uint8), behavior_logprobs=None,
                         raw_logprobs=None)
    with pytest.raises(RecordError, match=r"records-00001\.array_record\[0\]: field 'action_mask' "
                                          r"marks no model token"):
        write_records(tmp_path / "bad", records, records_per_shard=2)


# -- collation ---------------------------------------------------------------------------------


def test_collate_makes_environment_tokens_context_padded_and_packed():
    r = episode(mu_logprobs=episode().behavior_logprobs * 2)
    # what a writer that skipped validation could hold at an environment token
    unvalidated = r.replace(mu_logprobs=np.where(ACTION == 1, r.mu_logprobs, -9.0))
    row = record_row(unvalidated)
    # tokens 5 6 7 | 11 12 13 21 22 14 15: row positions 2..8 are the completion's targets
    np.testing.assert_array_equal(row["inputs"], [5, 6, 7, 11, 12, 13, 21, 22, 14])
    np.testing.assert_array_equal(row["targets"], [6, 7, 11, 12, 13, 21, 22, 14, 15])
    np.testing.assert_array_equal(row["loss_mask"], [0, 0, 1, 1, 1, 0, 0, 1, 1])
    want_mu = [0, 0, -0.5, -1.0, -1.5, 0, 0, -3.0, -3.5]
    np.testing.assert_allclose(row["mu_logprobs"], want_mu)
    np.testing.assert_allclose(row["behavior_logprobs"], np.asarray(want_mu) / 2)
    single = Record([1, 2], [3, 4], reward=0.0)
    padded = collate([row, record_row(single)], 2, (16,))
    np.testing.assert_array_equal(padded.loss_mask[0, :9], row["loss_mask"])
    np.testing.assert_array_equal(padded.loss_mask[1, :3], [0, 1, 1])
    packed = collate_packed([[record_row(single), row]], 1, 16, 2)
    np.testing.assert_array_equal(packed.loss_mask[0, :12], [0, 1, 1] + row["loss_mask"].tolist())
    np.testing.assert_allclose(packed.mu_logprobs[0, 3:12], want_mu)
    with pytest.raises(RecordError, match=r"^recs\[1\]: field 'action_mask' has shape \(2,\)"):
        record_row(episode(action_mask=[1, 0]), where="recs[1]")


# -- data show / data stats --------------------------------------------------------------------

SHOWN = """\
=== {where}  group 3  reward +1  correct  answer None
--- prompt (3 tokens)
What is 2+3?
--- episode (7 tokens: 5 model, 2 environment): 2 model turns, 1 tool calls
--- model turn 1 (tokens 0-2: 3, stop: end_of_turn)
<tool_call>{{"name": "calculator"}}</tool_call>
--- environment turn 1 (tokens 3-4: 2)  turn reward 0.25
tool call: calculator({{"expression": "2+3"}}) -> 5
tool_errors: 0
[tool calculator] 5
--- model turn 2 (tokens 5-6: 2, stop: stop)
The answer is 5."""


def test_data_show_renders_the_turns_and_single_turn_records_as_before(tmp_path, capsys):
    # the runner's record of an episode cut by the turn limit after a bad tool call, and one
    # whose environment raised (an empty span: its error ended the episode)
    truncated = episode(metadata={"episode": {
        "turns": [{"kind": "model", "start": 0, "end": 3, "stop": "end_of_turn"},
                  {"kind": "env", "start": 3, "end": 5,
                   "messages": [{"role": "tool", "content": "Error: unknown tool 'search'"}],
                   "info": {"tool_calls": [{"name": "search", "arguments": {"q": "x"},
                                            "error": "unknown tool 'search'"}]},
                   "reward": None},
                  {"kind": "model", "start": 5, "end": 7, "stop": "end_of_turn"},
                  {"kind": "env", "start": 7, "end": 7, "messages": [], "info": {},
                   "reward": None, "dropped_messages": [{"role": "user", "content": "again"}]}],
        "num_turns": 2, "tool_calls": 1, "truncated": "max_turns"}})
    raised = episode(metadata={"episode": {
        "turns": [{"kind": "model", "start": 0, "end": 7, "stop": "end_of_turn"},
                  {"kind": "env", "start": 7, "end": 7, "messages": [],
                   "info": {"error": "ZeroDivisionError: division by zero"}, "reward": None}],
        "num_turns": 1, "tool_calls": 0, "truncated": "env_error"}},
        action_mask=np.ones(7, np.uint8), behavior_logprobs=None, raw_logprobs=None)
    single = Record([1, 2], [3, 4], reward=-1.0, prompt_text="Q", completion_text="A",
                    answer="4")
    write_records(tmp_path / "recs", [episode(), truncated, raised, single])
    assert main(["data", "show", str(tmp_path / "recs")]) == 0
    shown = capsys.readouterr().out.split("=== ")
    where = f"{tmp_path}/recs/records-00000.array_record"
    assert "=== " + shown[1] == SHOWN.format(where=f"{where}[0]") + "\n"
    assert shown[2].endswith(
        "2 model turns, 1 tool calls, truncated: max_turns\n"
        "--- model turn 1 (tokens 0-2: 3, stop: end_of_turn)\n"
        "--- environment turn 1 (tokens 3-4: 2)\n"
        "tool call: search({\"q\": \"x\"}) -> error: unknown tool 'search'\n"
        "[tool] Error: unknown tool 'search'\n"
        "--- model turn 2 (tokens 5-6: 2, stop: end_of_turn)\n"
        "--- environment turn 2 (no tokens)\n"
        "(not shown to the model) [user] again\n"
        # model turns carry no text of their own here: the completion's text follows
        "--- completion text (all turns)\n<full text>\n")
    assert ("1 model turns, 0 tool calls, truncated: env_error\n"
            "--- model turn 1 (tokens 0-6: 7, stop: end_of_turn)\n"
            "--- environment turn 1 (no tokens)\n"
            "error: ZeroDivisionError: division by zero\n") in shown[3]
    assert "=== " + shown[4] == (f"=== {where}[3]  group 0  reward -1  incorrect  answer '4'\n"
                                 "--- prompt (2 tokens)\nQ\n--- completion (2 tokens)\nA\n")


def test_data_show_falls_back_to_the_mask_when_the_turns_disagree(tmp_path, capsys):
    wrong = episode(metadata={"episode": {"turns": [{"kind": "model", "start": 0, "end": 7}]}})
    write_records(tmp_path / "recs", [wrong])
    assert main(["data", "show", str(tmp_path / "recs")]) == 0
    out = capsys.readouterr().out
    assert "(metadata episode.turns[0] (model, tokens 0-7) disagrees with action_mask" in out
    assert ("--- model turn 1 (tokens 0-2: 3)\n--- environment turn 1 (tokens 3-4: 2)\n"
            "--- model turn 2 (tokens 5-6: 2)\n--- completion text (all turns)\n") in out


def test_data_stats_counts_turns_and_tool_calls_per_episode(tmp_path, capsys):
    three = np.asarray([1, 1, 0, 1, 0, 0, 1], np.uint8)  # 3 model turns, counted from the spans
    records = [
        episode(),
        episode(metadata={"episode": {"truncated": "max_turns", "turns": [  # calls counted
            {"kind": "model", "start": 0, "end": 2},
            {"kind": "env", "start": 2, "end": 3, "info": {"tool_calls": [{"name": "a"}]}},
            {"kind": "model", "start": 3, "end": 4},
            {"kind": "env", "start": 4, "end": 6, "info": {"tool_calls": [{"error": "bad"}]}},
            {"kind": "model", "start": 6, "end": 7}]}},
                action_mask=three, behavior_logprobs=None, raw_logprobs=None),
        episode(metadata={"episode": {"num_turns": 1, "tool_calls": 0, "truncated": "env_timeout"}},
                action_mask=np.asarray([1, 1, 1, 1, 1, 0, 0], np.uint8), behavior_logprobs=None,
                raw_logprobs=None),
        Record([1], [2, 3], reward=0.0),  # single-turn: not an episode
    ]
    write_records(tmp_path / "recs", records)
    assert main(["data", "stats", str(tmp_path / "recs")]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_records"] == 4
    assert stats["episodes"] == {
        "num_episodes": 3,
        "turns_per_episode": {"mean": 2.0, "min": 1.0, "max": 3.0},
        "tool_calls_per_episode": {"mean": 1.0, "min": 0.0, "max": 2.0},
        "model_tokens_per_episode": {"mean": 14 / 3, "min": 4.0, "max": 5.0},
        "environment_tokens_per_episode": {"mean": 7 / 3, "min": 2.0, "max": 3.0},
        "truncated": {"env_timeout": 1, "max_turns": 1},
    }
    write_records(tmp_path / "plain", [Record([1], [2, 3], reward=0.0)])
    assert main(["data", "stats", str(tmp_path / "plain")]) == 0
    assert "episodes" not in json.loads(capsys.readouterr().out)


# -- PKPO over episode rewards -----------------------------------------------------------------


def test_pkpo_transforms_episode_rewards_and_keeps_the_episodes(tmp_path):
    rewards = [[1.0, 0.0, 0.5, 0.0, 2.0], [0.0, 0.0, 1.0, 0.25, 0.5]]  # two prompts, 5 episodes
    records = [episode(reward=r, group_id=g, correct=r > 0.75)
               for g, group in enumerate(rewards) for r in group]
    write_records(tmp_path / "in", records)
    curate_directory(str(tmp_path / "in"), str(tmp_path / "out"), strategy="uniform",
                     transform="pkpo", pkpo_k=3)
    out = read_records(tmp_path / "out")  # every record, in curate's shuffled order
    assert len(out) == 10
    # PKPO eq. 33 by brute force over each prompt's episodes (tied rewards get equal values)
    want = {(g, raw): v for g, group in enumerate(rewards)
            for raw, v in zip(group, bf_sloo_minus_one(group, 3), strict=True)}
    for r in out:
        assert r.reward == pytest.approx(want[r.group_id, r.raw_reward], rel=1e-5, abs=1e-6)
        np.testing.assert_array_equal(r.action_mask, ACTION)
        assert r.metadata == episode().metadata


# -- a real episode: envs.EpisodeRunner's record -------------------------------------------------


def test_a_calculator_episode_record_is_valid_shown_and_counted(tmp_path, capsys):
    """The record `EpisodeRunner.finish` writes for a calculator episode with a good call and
    three bad ones passes validation and the shard writer, and shows and counts its turns."""
    from jaxrl_llm.envs.calculator import CalculatorEnv
    from jaxrl_llm.envs.episodes import EpisodeRunner
    from jaxrl_llm.envs.render import TurnRenderer
    from jaxrl_llm.tasks.arithmetic import ArithmeticTask
    from tests.envs.helpers import qwen_tokenizer

    task = ArithmeticTask()
    env = CalculatorEnv(task=task)
    renderer = TurnRenderer(qwen_tokenizer(), chat_template=True, tools=env.tools())
    runner = EpisodeRunner(env, renderer, max_turns=4, max_episode_tokens=1024, timeout_s=30,
                           workers=2)
    prob = task.load(num=3)[2]
    expression = prob.question.removeprefix("What is ").removesuffix("?")
    episode = runner.begin(prob)
    for text in (f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}'
                 "</tool_call>",
                 '<tool_call>{"name": "abacus", "arguments": {}}</tool_call><tool_call>{oops}'
                 "</tool_call>",
                 f"The answer is {prob.answer}."):
        ids = list(renderer.tokenizer.encode(text, add_special_tokens=False))
        ids.append(renderer.end_of_turn_id)
        runner.submit(episode, ids, [-0.1] * len(ids), True).result(timeout=60)
    rec = runner.finish(episode)
    write_records(tmp_path / "recs", [rec], vocab_size=len(renderer.tokenizer))
    back = read_records(tmp_path / "recs")[0]
    model = back.action_mask == 1
    assert 0 < model.sum() < model.size
    row = record_row(back)
    start = back.prompt_ids.size - 1
    np.testing.assert_array_equal(row["loss_mask"][start:], model)
    np.testing.assert_array_equal(row["behavior_logprobs"][start:][~model], 0.0)

    assert main(["data", "show", str(tmp_path / "recs")]) == 0
    out = capsys.readouterr().out
    assert "3 model turns, 3 tool calls\n" in out
    assert f'tool call: calculator({{"expression": "{expression}"}}) -> {prob.answer}\n' in out
    assert "tool call: abacus({}) -> error: unknown tool 'abacus'" in out
    assert "tool call: error: tool call 2: malformed JSON" in out
    assert out.count("--- model turn ") == 3 and out.count("--- environment turn ") == 3
    assert main(["data", "stats", str(tmp_path / "recs")]) == 0
    episodes = json.loads(capsys.readouterr().out)["episodes"]
    assert episodes["turns_per_episode"]["mean"] == 3 and episodes["tool_calls_per_episode"]["mean"] == 3
    assert episodes["model_tokens_per_episode"]["mean"] == model.sum()
