"""Issue 55 item 16: the pipeline trainers' progress lines in a log show each update count
once (the round's postfix used to redraw the count it had just printed)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest

from jaxrl_llm.config import config_from_dict
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.free import run_free
from jaxrl_llm.online.pipeline import run_pipeline
from tests.online.helpers import tiny

MODES = {"deterministic": {"staleness": 1}, "free": {"max_staleness": 1}}


@pytest.mark.parametrize("mode", ["deterministic", pytest.param("free", marks=pytest.mark.slow)])
def test_each_trainer_count_is_one_line(tmp_path: Path, mode: str,
                                        capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
    monkeypatch.setenv("JAXRL_PROGRESS_INTERVAL_S", "0")  # a line at every count
    tree = tiny(tmp_path / "run", mesh={"data": 4},
                online={"pipeline": mode, "sampler_devices": 4, **MODES[mode]})
    run = run_pipeline if mode == "deterministic" else run_free
    result = run(config_from_dict(tree, schema=OnlineConfig), progress=True)
    total = tree["online"]["rounds"] * tree["online"]["updates_per_round"]  # 3 updates
    assert result.updates == total
    err = capsys.readouterr().err
    counts = re.findall(rf"^trainer: (\d+)/{total} updates", err, re.M)
    assert counts == [str(k) for k in range(total + 1)], err
