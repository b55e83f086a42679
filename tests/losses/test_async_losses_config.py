"""Bad input for DPPO, TRM, OAPL, VCPO and AsymRE, refused before anything is loaded: options
out of range or of another loss (config validation, naming the key), packed rows for VCPO's
per-record gradient norms, records with one sample per prompt for a group loss, and records
without π_lag = μ for OAPL (the trainer's checks on the record directory)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, config_from_dict
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import write_records
from jaxrl_llm.data.stages import check_mu
from jaxrl_llm.losses.registry import markdown_table
from jaxrl_llm.train.preflight import check_records
from tests.reliability import record

NEW = ("dppo", "trm", "oapl", "vcpo", "asymre")


def config(name: str, **loss):
    return config_from_dict({"loss": {"name": name, **loss}})


OUT_OF_RANGE = [
    ("dppo", "dppo_delta", 0.0), ("dppo", "dppo_delta_low", -0.1),
    ("dppo", "dppo_ratio_cap", 0.0), ("dppo", "dppo_kl_tau", -1e-3),
    ("dppo", "dppo_divergence", "js"), ("trm", "trm_delta", 0.0),
    ("trm", "trm_delta_avg", -0.001), ("oapl", "oapl_beta", 0.0),
    ("oapl", "oapl_value_beta", -1.0), ("vcpo", "vcpo_is_cap", 0.0),
    ("vcpo", "vcpo_ess_base", 1.5), ("vcpo", "vcpo_ess_base", 0.0),
    ("vcpo", "vcpo_ess_rule", "cube"), ("vcpo", "vcpo_baseline", "critic"),
    ("asymre", "asymre_delta_v", 0.1),
]


@pytest.mark.reliability
def test_options_out_of_range_name_the_key():
    failures, first = 0, ""
    for name, key, value in OUT_OF_RANGE:
        try:
            config(name, **{key: value})
        except ConfigError as err:
            failures += key not in str(err)
            first = first or next(line for line in str(err).splitlines() if key in line)
        else:
            failures += 1
    record("bad input", "async-RL loss option out of range (dppo, trm, oapl, vcpo, asymre)",
           runs=len(OUT_OF_RANGE), failures=failures,
           detail=f"{len(OUT_OF_RANGE)} values refused at config load naming the key, e.g. "
                  f"loss.dppo_delta=0.0 -> {first}")
    assert failures == 0


@pytest.mark.parametrize("name,key,value", [
    ("topr", "dppo_delta", 0.2), ("dppo", "trm_delta", 0.1), ("trm", "oapl_beta", 0.1),
    ("grpo", "vcpo_is_cap", 4.0), ("oapl", "asymre_delta_v", -0.2),
    ("oapl", "aggregation", "token-mean"), ("oapl", "std_ddof", 1),
])
def test_an_option_of_another_loss_is_refused(name, key, value):
    with pytest.raises(ConfigError, match=f"loss.{key} has no effect with loss.name={name}"):
        config(name, **{key: value})


def test_rules_over_several_options():
    with pytest.raises(ConfigError, match="loss.std_ddof=1 has no effect"):
        config("dppo", std_ddof=1)
    config("dppo", std_ddof=1, dppo_std_scale=True)
    with pytest.raises(ConfigError, match="loss.vcpo_ess_base=0.5 has no effect"):
        config("vcpo", vcpo_ess_rule="off", vcpo_ess_base=0.5)
    with pytest.raises(ConfigError, match="loss.std_ddof=1 has no effect"):
        config("vcpo", vcpo_std_scale=False, std_ddof=1)
    with pytest.raises(ConfigError, match="length_norm=false and loss.aggregation"):
        config("asymre", length_norm=False, aggregation="token-mean")
    with pytest.raises(ConfigError, match="loss.baseline=0.3 has no effect"):
        config("asymre", baseline=0.3)  # AsymRE's baseline is the group's, shifted by δV


def test_vcpo_refuses_packed_rows():
    with pytest.raises(ConfigError, match="data.pack=true cannot train loss.name=vcpo"):
        config_from_dict({"loss": {"name": "vcpo"}, "data": {"pack": True}})
    config_from_dict({"loss": {"name": "dppo"}, "data": {"pack": True}})


def test_the_readme_table_marks_what_each_needs():
    rows = {line.split("|")[1].strip(" `"): line.split("|") for line in
            markdown_table().splitlines()[2:]}
    for name in NEW:  # μ for all but AsymRE, whole groups for all
        assert rows[name][2].strip() == ("" if name == "asymre" else "✓"), name
        assert rows[name][5].strip() == "✓", name


def write(path, group_of, *, scored: bool):
    rng = np.random.default_rng(0)
    records = []
    for i, g in enumerate(group_of):
        c = 3
        records.append(Record(
            prompt_ids=np.array([1, 2 + g]), completion_ids=rng.integers(1, 30, c),
            reward=float(i % 2), correct=bool(i % 2), group_id=int(g),
            behavior_logprobs=-rng.random(c).astype(np.float32),
            mu_logprobs=-rng.random(c).astype(np.float32) if scored else None))
    write_records(path, records, vocab_size=32)
    return path


@pytest.mark.reliability
def test_one_record_per_group_is_refused_before_loading(tmp_path):
    singles = write(tmp_path / "singles", range(8), scored=True)
    grouped = write(tmp_path / "grouped", np.repeat([0, 1], 4), scored=True)
    messages = []
    for name in NEW:
        with pytest.raises(ConfigError, match=r"8 records in 8 groups, one record each") as err:
            check_records(config(name), singles)
        messages.append(str(err.value).replace(str(tmp_path), "DIR"))
        check_records(config(name), grouped)
    record("bad input", "group loss on records with one sample per prompt", runs=len(NEW),
           failures=0, detail=f"dppo/trm/oapl/vcpo/asymre refused before the model loads -> "
                              f"{messages[0]}")


@pytest.mark.reliability
def test_oapl_without_the_lagged_policy_s_log_probs_is_refused(tmp_path):
    """π_lag is the policy that sampled the records: μ. Records with neither the score
    pass's μ nor (with loss.mu_source=sampler) the sampler's own are refused, naming the fix."""
    raw = write(tmp_path / "raw", np.repeat([0, 1], 4), scored=False)
    with pytest.raises(ConfigError, match="jaxrl-llm score") as err:
        check_mu(config("oapl"), raw)
    check_mu(config("asymre"), raw)  # AsymRE reads no μ
    record("bad input", "OAPL on records without π_lag (μ) log-probs", runs=1, failures=0,
           detail=f"train on unscored records -> {str(err.value).replace(str(tmp_path), 'DIR')}")
