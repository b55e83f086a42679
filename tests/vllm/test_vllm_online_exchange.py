"""A vLLM rollout worker of the storage pipeline (`online.exchange`, `generate.backend: vllm`
with `--role worker`) beside the JAX trainer: each published version is reloaded into the
running engine in place.

Independent check: μ is the trainer's re-score of every round under θ_U(r) (the version the
round's shard names), and vLLM's own log-probs of the same tokens agree with it to float32
precision in every round, the ones sampled after a reload included — while the trained weights
moved far from the initial ones, so an engine still on θ_0 could not agree.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.online.helpers import final_arrays, metric_rows
from tests.vllm.test_vllm_iterate import command, env

pytestmark = [pytest.mark.slow]


def test_vllm_worker_samples_each_published_version(tmp_path: Path, tiny_hf: Path) -> None:
    config = {
        "run_dir": "run", "seed": 0, "model": {"source": "hf", "path": str(tiny_hf)},
        "loss": {"name": "topr"}, "optim": {"name": "adamw", "learning_rate": 3e-2},
        "train": {"batch_size": 8, "max_seq_len": 64},
        "generate": {"backend": "vllm", "n": 4, "temperature": 1.0, "max_new_tokens": 12,
                     "batch_size": 8},
        "data": {"task": "arithmetic", "num_prompts": 16},
        "online": {"rounds": 3, "staleness": 1, "prompts_per_round": 2, "mu_source": "trainer",
                   "pipeline": "deterministic", "exchange": "exchange", "worker_timeout_s": 600},
    }
    (tmp_path / "online.yaml").write_text(yaml.safe_dump(config))
    logs = {side: (tmp_path / f"{side}.log").open("w") for side in ("trainer", "worker")}
    procs = {side: subprocess.Popen(command("online", "--config", "online.yaml", "--no-progress",
                                            "--role", side, *(["--worker", "0"] if side ==
                                                              "worker" else [])),
                                    cwd=tmp_path, env=env(), stdout=logs[side],
                                    stderr=subprocess.STDOUT)
             for side in ("trainer", "worker")}
    for side, proc in procs.items():
        code = proc.wait(1200)
        assert code == 0, (tmp_path / f"{side}.log").read_text()[-4000:]
    out = (tmp_path / "worker.log").read_text()
    summary = json.loads(out[out.rindex("{"):])
    assert summary["sampled_rounds"] == 4 and summary["engine"].startswith("vllm")
    rows = metric_rows(tmp_path / "run")
    assert [r["pipeline/version"] for r in rows] == [0.0, 0.0, 1.0, 2.0]
    for r in rows:  # vLLM's log-probs against the JAX re-score under the round's version
        assert r["mu_mismatch_max"] < 1e-3 and r["mu_mismatch_mean"] < 1e-5, r
    # ... while consecutive versions differ by far more: update u's log π_θu/μ on a batch
    # θ_u−1 sampled reaches ~1 nat here, what an engine left on an old version would be off by
    assert max(abs(r["loss/log_ratio_max"]) for r in rows[2:]) > 0.1
    _, state = final_arrays(tmp_path / "run")
    from safetensors.numpy import load_file

    initial = load_file(str(tiny_hf / "model.safetensors"))
    embed = next(v for k, v in state.items() if "params" in k and "embed" in k)
    assert np.abs(embed - initial["model.embed_tokens.weight"]).max() > 1e-3  # it trained
