"""The shipped Qwen3-8B long-row configs (65,536 and 131,072 tokens per row on a v5e-256):
their model is Qwen3-8B with YaRN to 131,072 positions, their split divides the row, and
`plan` refuses, before compiling, the same row without the context split (numbers checked by
hand below). Their compiled figures are in docs/plan.md (a compile takes minutes here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxrl_llm.config import load_config
from jaxrl_llm.plan import libtpu_available
from jaxrl_llm.weights.loading import decoder_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QWEN3 = {65536: "topr_gsm8k_qwen3_8b_64k_v5e256.yaml", 131072: "topr_gsm8k_qwen3_8b_128k_v5e256.yaml"}


@pytest.mark.parametrize("tokens", list(QWEN3))
def test_qwen3_long_configs_use_yarn_to_cover_their_rows(tokens):
    config = load_config(CONFIGS / QWEN3[tokens])
    decoder = decoder_config(config.model)  # /mnt/models/... is not here: the section's keys
    assert decoder.family == "qwen3" and decoder.num_layers == 36
    assert dict(decoder.rope_scaling) == {"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 32768}
    assert config.train.max_seq_len == tokens <= decoder.max_position_embeddings == 4 * 32768
    assert config.train.max_seq_len % (2 * config.mesh.context) == 0
    assert config.train.max_seq_len // config.mesh.context == 16384  # tokens per chip


@pytest.mark.skipif(not libtpu_available(), reason="needs the `tpu` extra (PyPI libtpu)")
def test_plan_refuses_qwen3_64k_without_the_split_before_compiling(monkeypatch):
    """One 65,536-token row per v5e chip: Qwen3-8B's 36 layer inputs alone are
    36 × 65,536 × 4,096 × 2 bytes = 18 GiB > 16 GiB, refused without building the step; the
    shipped split (mesh.context=4) passes the check and goes on to compile."""
    from jaxrl_llm import plan as plan_module

    def no_compile(*args, **kwargs):
        raise AssertionError("plan compiled a step it should have refused")

    monkeypatch.setattr(plan_module, "make_train_step", no_compile)
    whole = load_config(CONFIGS / QWEN3[65536], ["mesh.context=1"])
    floor = 36 * 65536 * 4096 * 2 / 2**30
    assert floor == 18.0
    with pytest.raises(plan_module.PlanOutOfMemory) as err:
        plan_module.make_plan(whole)
    message = str(err.value)
    for named in ("refused before compiling", "36 layer inputs", "65,536 tokens per row / "
                  "mesh.context=1, 1 row(s) per chip", f"{floor:.2f} GiB, over the chip's 16.00 GiB",
                  "Raise mesh.context", "train.micro_batch_size", "train.max_seq_len",
                  "mesh.fsdp"):
        assert named in message, (named, message)
    with pytest.raises(AssertionError, match="compiled a step"):  # past the check, to compile
        plan_module.make_plan(load_config(CONFIGS / QWEN3[65536]))
