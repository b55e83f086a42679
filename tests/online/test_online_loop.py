"""`online.loop.run_online`: staleness as measured by the step's own π/μ log-ratio, the μ
source decision, the per-round metrics, and clear errors for configs it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxrl_llm.config import ConfigError, config_from_dict
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.loop import run_online
from tests.online.helpers import metric_rows, tiny


def _run(tmp_path: Path, name: str, **sections) -> list[dict]:
    config = config_from_dict(tiny(tmp_path / name, **sections), schema=OnlineConfig)
    result = run_online(config, progress=False)
    assert result.updates == config.online.rounds
    return metric_rows(tmp_path / name)


@pytest.mark.slow  # moved out of the default suite (10 min 27 s on 2026-11-28); CI runs it (16 s)
def test_staleness_zero_is_on_policy_and_one_is_not(tmp_path: Path) -> None:
    # μ re-scored by the weights that sampled: at s = 0 the trained policy IS the sampler, so
    # the step's log π − log μ is ~0 at every update; at s = 1 it is 0 only while the batch
    # and the policy are both θ0 (the first two updates), then the policy has moved on.
    on = _run(tmp_path, "s0", online={"rounds": 3, "staleness": 0, "mu_source": "trainer"})
    off = _run(tmp_path, "s1", online={"rounds": 3, "staleness": 1, "mu_source": "trainer"})
    assert len(on) == 3 and len(off) == 4  # s = 1 adds one round that only fills the queue
    assert [r["round_updates"] for r in off] == [0, 1, 1, 1]
    assert all(abs(r["loss/log_ratio_max"]) < 1e-5 for r in on), [r["loss/log_ratio_max"] for r in on]
    assert abs(off[1]["loss/log_ratio_max"]) < 1e-5  # update 0: θ0 on θ0's samples
    assert off[2]["loss/log_ratio_max"] > 1e-4  # update 1: θ1 on θ0's samples
    assert off[3]["loss/log_ratio_max"] > 1e-4  # update 2: θ2 on θ1's samples
    # the same seed samples the same first round whatever the staleness
    assert on[0]["completion_tokens"] == off[1]["completion_tokens"]
    for row in on:
        for key in ("reward_mean", "pass@1", "pass@4", "loss/ess", "seconds_sampling",
                    "seconds_training", "mu_mismatch_max", "loss/clip_frac_pos_high"):
            assert key in row, key
    # trainer numerics vs the sampler's on the same weights (fp32, untruncated)
    assert max(r["mu_mismatch_max"] for r in on) < 1e-4


@pytest.mark.slow
def test_auto_mu_source_keeps_sampler_logprobs_within_the_bound(tmp_path: Path) -> None:
    rows = _run(tmp_path, "auto", online={"rounds": 2})
    assert rows[0]["mu_from_sampler"] == 1.0 and rows[0]["mu_mismatch_max"] < 1e-4
    assert "mu_mismatch_max" not in rows[1]  # decided once: no re-score after round 0
    strict = _run(tmp_path, "strict", online={"rounds": 2, "max_mu_mismatch": 1e-12})
    if strict[0]["mu_mismatch_max"] > 1e-12:  # any difference at all: re-scored every round
        assert [r["mu_from_sampler"] for r in strict] == [0.0, 0.0]
        assert "mu_mismatch_max" in strict[1]


@pytest.mark.parametrize(("override", "message"), [
    ({"online": {"prompts_per_round": 3}}, "online.prompts_per_round"),
    ({"loss": {"name": "dpo"}}, "pairs"),
    ({"generate": {"top_k": 5}, "online": {"mu_source": "sampler"}}, "online.mu_source=sampler"),
    ({"data": {"group_transform": "pkpo"}}, "online.pkpo_k"),
    ({"data": {"group_transform": "pkpo"}, "online": {"pkpo_k": [8]}}, "exceeds generate.n"),
])
def test_bad_configs_name_the_key(tmp_path: Path, override: dict, message: str) -> None:
    config = config_from_dict(tiny(tmp_path / "bad", **override), schema=OnlineConfig)
    with pytest.raises(ConfigError, match=message):
        run_online(config, progress=False)
    assert not (tmp_path / "bad").exists()  # refused before anything was written


def test_pkpo_k_follows_the_schedule_and_transforms_each_round(tmp_path: Path) -> None:
    rows = _run(tmp_path, "pkpo", online={"rounds": 4, "pkpo_k": [4, 2, 1]},
                data={"group_transform": "pkpo", "reward_scheme": "01"},
                loss={"name": "reinforce"})
    assert [r["pkpo_k"] for r in rows] == [4, 2, 1, 1]  # the last value repeats
    # 0/1 rewards, all wrong on a random model: PKPO's weights are 0, so no gradient at all
    assert all(r["reward_mean"] == 0.0 for r in rows)
    assert all(r["grad_norm"] == 0.0 for r in rows)


def test_eval_hook_runs_at_every_multiple_of_eval_every_and_logs(tmp_path: Path) -> None:
    # s = 1 and 5 rounds with 1 update each: rounds 0..5, updates after each 0,1,2,3,4,5;
    # eval_every 2 → probes at updates 2 and 4, plus the last update (5)
    seen: list[tuple[int, int]] = []

    def hook(updates, policy):
        seen.append((updates, policy.updates))
        return {"pass_at_1": updates / 10}

    config = config_from_dict(tiny(tmp_path / "hook", online={"rounds": 5, "staleness": 1}),
                              schema=OnlineConfig)
    run_online(config, progress=False, eval_hook=hook, eval_every=2)
    assert seen == [(2, 2), (4, 4), (5, 5)]
    rows = metric_rows(tmp_path / "hook")
    assert [r.get("eval/pass_at_1") for r in rows] == [None, None, 0.2, None, 0.4, 0.5]
    with pytest.raises(ValueError, match="eval_every"):
        run_online(config, progress=False, eval_hook=hook)
