"""One config drives generate → score → curate → train: which directory each stage reads
(data/stages.py), and the refusals before anything trains on the wrong data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl_llm.cli import main
from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import read_manifest, write_records
from jaxrl_llm.data.stages import check_mu, stage_input, stage_output


def records(num: int = 8, *, scored: bool, correct=lambda i: i % 2 == 0, group: int = 4) -> list[Record]:
    rng = np.random.default_rng(num)
    out = []
    for i in range(num):
        c = int(rng.integers(1, 5))
        out.append(Record(
            prompt_ids=rng.integers(1, 50, 3), completion_ids=rng.integers(1, 50, c),
            reward=1.0 if correct(i) else -1.0, correct=correct(i), group_id=i // group,
            mu_logprobs=-rng.random(c) - 0.01 if scored else None))
    return out


@pytest.fixture
def chain(tmp_path):
    """A generate output `data/records` and its score output `data/records-scored`."""
    generated, scored = tmp_path / "data" / "records", tmp_path / "data" / "records-scored"
    write_records(generated, records(scored=False))
    write_records(scored, records(scored=True), scored_by="policy")
    return tmp_path, str(generated), str(scored)


def test_each_stage_reads_what_the_previous_one_wrote(chain):
    tmp, generated, scored = chain
    config = load_config(None, [f"data.records={generated}", f"data.curated={tmp}/data/curated"])
    assert stage_input(config, "score") == generated
    assert stage_output(config, "score") == scored  # <data.records>-scored
    assert stage_input(config, "curate") == scored  # the scored records, not the generated ones
    assert stage_output(config, "curate") == f"{tmp}/data/curated"
    # data.curated is set but curate has not run: train refuses, naming the key and the fix
    with pytest.raises(ConfigError, match=r"data\.curated=.*data/curated holds no records.*"
                                          r"jaxrl-llm curate"):
        stage_input(config, "train")
    write_records(f"{tmp}/data/curated", records(scored=True), scored_by="policy")
    assert stage_input(config, "train") == f"{tmp}/data/curated"
    # without data.curated train reads the scored records; an explicit --records wins
    plain = load_config(None, [f"data.records={generated}"])
    assert stage_input(plain, "train") == scored
    assert stage_input(plain, "train", generated) == generated


def test_score_output_key_and_unscored_chain(tmp_path):
    generated = tmp_path / "gen"
    write_records(generated, records(scored=False))
    config = load_config(None, [f"data.records={generated}", f"generate.score_output={tmp_path}/mu"])
    assert stage_output(config, "score") == f"{tmp_path}/mu"
    assert stage_input(config, "curate") == str(generated)  # nothing scored yet
    write_records(f"{tmp_path}/mu", records(scored=True), scored_by="policy")
    assert stage_input(config, "curate") == f"{tmp_path}/mu"
    with pytest.raises(ConfigError, match="set data.records"):
        stage_input(load_config(None, []), "curate")


def test_curate_cli_reads_the_scored_records(chain, capsys):
    tmp, generated, scored = chain
    out = tmp / "data" / "curated"
    assert main(["curate", f"data.records={generated}", f"data.curated={out}",
                 "data.curation=uniform"]) == 0
    assert json.loads(capsys.readouterr().out)["output"] == str(out)
    assert read_manifest(out).extra["curation"]["source"] == scored
    assert read_manifest(out).scored_by == "policy"


def test_a_ratio_loss_refuses_unscored_records_before_training(chain):
    tmp, generated, _ = chain
    config = load_config(None, [f"data.records={generated}", "loss.name=topr"])
    with pytest.raises(ConfigError, match=rf"loss\.name=topr .*{generated} has no mu_logprobs.*"
                                          r"jaxrl-llm score"):
        check_mu(config, generated)
    check_mu(load_config(None, ["loss.name=sft"]), generated)  # sft reads no μ
    check_mu(load_config(None, ["loss.name=topr", "loss.mu_source=sampler"]), generated)
    # The trainer refuses at construction, before any model or mesh is built.
    from jaxrl_llm.train.trainer import Trainer

    with pytest.raises(ConfigError, match="has no mu_logprobs"):
        Trainer(config, records=generated, run_dir=tmp / "run", progress=False, tensorboard=False)


def test_dpo_curation_without_positives_is_an_error_and_writes_nothing(tmp_path, capsys):
    source = tmp_path / "wrong"
    write_records(source, records(12, scored=True, correct=lambda i: False), scored_by="policy")
    out = tmp_path / "curated"
    code = main(["curate", "--records", str(source), "--out", str(out), "data.curation=dpo"])
    err = capsys.readouterr().err
    assert code == 2
    # 12 records in 3 groups of 4, none correct: 0 positives, 0 mixed groups
    assert "'dpo'" in err and "0 positives" in err and "0 mixed groups" in err, err
    assert str(source) in err
    assert not out.exists()
