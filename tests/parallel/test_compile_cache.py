"""The persistent compilation cache of the device commands (`parallel/compile_cache.py`): which
directory each environment and platform choose, and `jaxrl-llm train` run twice from a temp
directory with `JAXRL_COMPILATION_CACHE` set: the first run writes compiled programs there, the
second reads them and writes the same metric rows."""

from __future__ import annotations

import json
import os
import subprocess

import jax
import pytest
import yaml

from jaxrl_llm.parallel.compile_cache import DEFAULT_DIR, enable_compilation_cache
from tests.train.test_nonfinite_trainer import jaxrl_llm_command
from tests.train.test_trainer import records, tiny_config  # noqa: F401 (records: a fixture)


@pytest.fixture
def restored_cache_dir():
    before = jax.config.jax_compilation_cache_dir
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_cache_directory_by_platform_and_environment(restored_cache_dir):
    before = jax.config.jax_compilation_cache_dir
    assert enable_compilation_cache({}, platform="cpu") is None  # CPU: off unless asked
    assert jax.config.jax_compilation_cache_dir == before
    for platform in ("tpu", "gpu"):
        assert enable_compilation_cache({}, platform=platform) == os.path.expanduser(DEFAULT_DIR)
        assert jax.config.jax_compilation_cache_dir == os.path.expanduser(DEFAULT_DIR)
    assert enable_compilation_cache({"JAXRL_COMPILATION_CACHE": "off"}, platform="tpu") is None
    assert enable_compilation_cache({"JAXRL_COMPILATION_CACHE": "/x/c"}, platform="cpu") == "/x/c"
    assert jax.config.jax_compilation_cache_dir == "/x/c"
    # JAX's own variable wins and is left to JAX (it reads it itself)
    env = {"JAX_COMPILATION_CACHE_DIR": "/y", "JAXRL_COMPILATION_CACHE": "/x/c"}
    assert enable_compilation_cache(env, platform="tpu") == "/y"


def test_train_command_reuses_its_compiled_programs(tmp_path, records):  # noqa: F811
    tree = json.loads(tiny_config(tmp_path / "unused", records).model_dump_json())
    tree["data"]["records"] = str(records)
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(tree))
    env = dict(os.environ, JAXRL_COMPILATION_CACHE="xla_cache",  # relative to the cwd
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_LOG_COMPILES="1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    rows = []
    for run in ("first", "second"):
        proc = subprocess.run(
            [*jaxrl_llm_command(), "train", "--config", "train.yaml", "--no-progress",
             f"run_dir={run}"], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        entries = sorted(p.name for p in (tmp_path / "xla_cache").iterdir())
        hit = "Persistent compilation cache hit for 'jit_train_step'" in proc.stderr
        if run == "first":
            written = entries
            assert any("train_step" in name for name in written), written
            assert not hit, proc.stderr[-3000:]
        elif "XLA:CPU AOT result" in proc.stderr:  # the loader refused the entry (module doc)
            pytest.skip("XLA:CPU rejects its own cached executables on this host "
                        "(jax-ml/jax#38445): the cache is off by default on CPU for this reason")
        else:
            assert hit, proc.stderr[-3000:]
        rows.append([{k: v for k, v in json.loads(line).items() if "time" not in k
                      and not k.endswith("_s") and "per_s" not in k and k != "tok_s"}
                     for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()])
    assert entries == written  # the second run wrote nothing new
    assert rows[0] == rows[1] and len(rows[0]) == 3
