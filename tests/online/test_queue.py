"""The staleness queue: update u trains on the batch sampled by the policy of update u − s."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_llm.data.records import Record
from jaxrl_llm.online.queue import StalenessQueue
from jaxrl_llm.online.rounds import k_for_round, logprob_mismatch, prompt_slice, reward_metrics


def _loop(staleness: int, per_round: int, rounds: int) -> list[tuple[int, int]]:
    """The online loop's queue discipline; (update index, policy version that sampled)."""
    queue = StalenessQueue(staleness)
    total = rounds * per_round
    trained: list[tuple[int, int]] = []
    updates = 0
    while updates < total:
        version = updates  # the policy sampling this round
        for _ in range(per_round):
            queue.push([Record(prompt_ids=[1], completion_ids=[2], reward=float(version))])
        while queue.ready() and updates < total:
            trained.append((updates, int(queue.pop()[0].reward)))
            updates += 1
    return trained


@pytest.mark.parametrize("staleness", [0, 1, 3, 8])
def test_update_trains_on_samples_s_updates_old(staleness: int) -> None:
    trained = _loop(staleness, per_round=1, rounds=12)
    assert [u for u, _ in trained] == list(range(12))
    assert [v for _, v in trained] == [max(0, u - staleness) for u in range(12)]


def test_several_updates_per_round_add_their_position() -> None:
    # batch j of a round of m updates is j updates older than batch 0 (PPO-style epochs)
    trained = _loop(staleness=2, per_round=2, rounds=5)
    assert [v for _, v in trained] == [0, 0, 0, 0, 2, 2, 4, 4, 6, 6]


def test_queue_json_roundtrip_is_exact() -> None:
    rng = np.random.default_rng(0)
    lp = rng.normal(size=5).astype(np.float32)
    r = Record(prompt_ids=[1, 2], completion_ids=[3, 4, 5, 6, 7], reward=0.1234567,
               raw_reward=-1.0, correct=True, group_id=7, behavior_logprobs=lp,
               raw_logprobs=lp * 2, mu_logprobs=lp / 3)
    q = StalenessQueue(1, [[r]])
    back = StalenessQueue.from_json(0, q.to_json()).pop()[0]
    for name in ("behavior_logprobs", "raw_logprobs", "mu_logprobs"):
        assert np.array_equal(getattr(back, name), getattr(r, name))
    assert back.completion_ids.tolist() == [3, 4, 5, 6, 7] and back.group_id == 7
    assert back.reward == r.reward and back.raw_reward == -1.0 and back.correct
    with pytest.raises(IndexError, match="staleness 1"):
        StalenessQueue(1, [[r]]).pop()


def _whole_records() -> list[Record]:
    """Records with every field set the way the online loop sets them, in-flight
    `weight_versions` included (and some fields None)."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(3):
        c = 4 + i
        lp = -rng.random(c).astype(np.float32)
        out.append(Record(
            prompt_ids=rng.integers(0, 100, 5), completion_ids=rng.integers(0, 100, c),
            reward=float(rng.normal()), raw_reward=None if i == 2 else 1.0, correct=i == 0,
            invalid=i == 1, group_id=i // 2, task="gsm8k", behavior_logprobs=lp,
            raw_logprobs=lp * 1.5, mu_logprobs=None if i == 1 else lp / 3,
            ref_logprobs=lp / 7 if i == 0 else None, answer=None if i else "42",
            prompt_text="Q: 6 × 7?", completion_text="é 42",
            metadata={"problem_id": f"p{i}", "finish_reason": "stop", "score": 0.25,
                      "weight_versions": [[3, 0], [4, 2]]}))
    return out


def test_queue_bytes_roundtrip_is_bit_for_bit_with_metadata() -> None:
    records = _whole_records()
    q = StalenessQueue(2, [records[:2], records[2:], []])
    back = StalenessQueue.from_bytes(2, q.to_bytes(), where="queue")
    assert [len(b) for b in back.batches()] == [2, 1, 0]
    got = [r for b in back.batches() for r in b]
    # every field, dtypes, None and metadata included: the record codec's bytes are equal
    assert [r.to_bytes() for r in got] == [r.to_bytes() for r in records]
    assert got[0].metadata["weight_versions"] == [[3, 0], [4, 2]]
    assert got[0].completion_text == "é 42" and got[1].mu_logprobs is None
    assert got[2].behavior_logprobs.dtype == np.float32 and back.to_bytes() == q.to_bytes()


def test_queue_survives_a_checkpoint_and_old_json_checkpoints_still_resume(tmp_path) -> None:
    """The queue is its own item of the checkpoint step (record codec, metadata kept); a
    checkpoint from before it (the JSON lists in the online meta) resumes as it did."""
    import jax.numpy as jnp

    from jaxrl_llm.online.loop import ONLINE_META, RunState
    from jaxrl_llm.online.queue import QUEUE_ITEM
    from jaxrl_llm.train.checkpoint import Checkpointer

    records = _whole_records()
    run = RunState(1)
    run.round, run.position, run.updates, run.mu_source = 3, 6, 2, "sampler"
    run.queue = StalenessQueue(1, [records[:2], records[2:]])
    old = {**run.meta(), "queue": run.queue.to_json()}  # the format before QUEUE_ITEM
    with Checkpointer(tmp_path / "ckpt", async_save=False, keep=5) as ckpt:
        ckpt.save(1, {"w": jnp.ones(2)}, force=True, meta={ONLINE_META: run.meta()},
                  blobs=run.blobs())
        ckpt.save(2, {"w": jnp.ones(2)}, force=True, meta={ONLINE_META: old})
        ckpt.save(3, {"w": jnp.ones(2)}, force=True, meta={ONLINE_META: run.meta()})
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        assert "queue" not in ckpt.read_meta(1)[ONLINE_META]
        loaded = []
        for step in (1, 2, 3):
            resumed = RunState(1)
            meta, payload = ckpt.read_meta(step)[ONLINE_META], ckpt.read_blob(QUEUE_ITEM, step)
            if step == 3:  # neither format: refused, naming the step
                with pytest.raises(ValueError, match="holds no staleness queue"):
                    resumed.load(meta, payload, where=f"step {step}")
                continue
            resumed.load(meta, payload)
            assert (resumed.round, resumed.position, resumed.updates) == (3, 6, 2)
            loaded.append([r for b in resumed.queue.batches() for r in b])
    assert [r.to_bytes() for r in loaded[0]] == [r.to_bytes() for r in records]
    # the JSON queue: what training reads, exactly (it never held the text or metadata)
    for got, want in zip(loaded[1], records, strict=True):
        for name in ("prompt_ids", "completion_ids", "behavior_logprobs", "raw_logprobs",
                     "mu_logprobs"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None and b is None) or np.array_equal(a, b), name
        assert (got.reward, got.raw_reward, got.group_id) == (want.reward, want.raw_reward,
                                                               want.group_id)
        assert got.metadata == {}


def test_round_helpers() -> None:
    assert prompt_slice(14, 4, 16) == [14, 15, 0, 1]
    assert [k_for_round([8, 4, 1], None, i) for i in range(5)] == [8, 4, 1, 1, 1]
    assert k_for_round(None, 2, 9) == 2
    recs = [Record(prompt_ids=[1], completion_ids=[2], reward=1.0 if c else -1.0, correct=c,
                   group_id=g) for g, c in [(0, True), (0, False), (1, False), (1, False)]]
    m = reward_metrics(recs, 2, [1])
    # group 0: 1 of 2 correct -> pass@1 0.5, pass@2 1; group 1: 0 -> mean 0.25 / 0.5
    assert m["pass@1"] == pytest.approx(0.25) and m["pass@2"] == pytest.approx(0.5)
    assert m["reward_mean"] == pytest.approx(-0.5)
    mm = logprob_mismatch([np.array([0.0, -1.0]), np.array([])], [np.array([0.5, -1.0]), np.array([])])
    assert mm == {"mu_mismatch_max": 0.5, "mu_mismatch_mean": 0.25}


def test_free_running_weights_hold_at_most_the_newest_and_the_one_sampling():
    """`online.pipeline: free` samples only with the newest version: a trainer that publishes
    faster than the sampler takes leaves at most two versions on the sampler's devices (the
    one sampling now and the newest), where the deterministic pipeline keeps every version a
    later round still needs."""
    from jaxrl_llm.online.sampler_side import Weights

    free, kept = Weights(newest_only=True), Weights()
    for w in (free, kept):
        w.put(0, "θ0")
    assert free.take_newest() == (0, "θ0")
    for v in range(1, 6):
        free.put(v, f"θ{v}")
        kept.put(v, f"θ{v}")
        assert free.held() <= 2  # θ0 (sampling) and θ_v
    assert kept.held() == 6
    assert free.take_newest(after=5) is None
    assert free.take_newest(after=0) == (5, "θ5") and free.held() == 1
    assert kept.take(3) == "θ3" and kept.held() == 3  # θ3, θ4, θ5 may still be needed
