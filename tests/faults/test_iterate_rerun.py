"""`iterate`'s sample-metrics row survives a re-run of the generate stage (a kill between the
row and the stage's mark in stages.json) without being logged twice."""

from __future__ import annotations

import json

import numpy as np

from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import write_records
from jaxrl_llm.flows.iterate import IterateConfig, record_sample_metrics


def test_a_rerun_iteration_replaces_its_row(tmp_path):
    correct = [True, False, False, False]  # groups 0 and 1, two samples each
    write_records(tmp_path / "recs", [
        Record(prompt_ids=np.array([1, 2]), completion_ids=np.array([3 + i]), reward=float(c),
               correct=c, group_id=i // 2) for i, c in enumerate(correct)], vocab_size=16)
    config = IterateConfig.model_validate({
        "run_dir": str(tmp_path / "run"), "data": {"num_prompts": 2}, "train": {"steps": 3},
        "iterate": {"iterations": 2}})
    (tmp_path / "run").mkdir()
    for index in (1, 1, 2, 2):  # each iteration's generate stage run twice
        record_sample_metrics(config, index, tmp_path / "recs")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 3]
    assert rows[0]["samples/accuracy"] == 0.25
    # 4 tasks over both iterations; iteration 1 solved its task 0, iteration 2 its task 2.
    assert [r["samples/cumulative_solve_rate"] for r in rows] == [0.25, 0.5]
