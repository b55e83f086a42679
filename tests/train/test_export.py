"""`jaxrl-llm export`: a trained checkpoint becomes an HF directory that transformers loads
and that gives our logits; writes are atomic."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl_llm.cli import main as cli_main
from jaxrl_llm.config import MeshConfig, config_from_dict
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import write_records
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.train.checkpoint import restore_model
from jaxrl_llm.train.trainer import Trainer


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> tuple[Path, object]:
    """Two training steps of a tiny random Llama (char-tokenizer vocab) on one device."""
    root = tmp_path_factory.mktemp("export")
    rng = np.random.default_rng(1)
    records = [
        Record(prompt_ids=np.array([5, 6 + i]), completion_ids=rng.integers(3, 100, size=5),
               reward=1.0 if i % 2 else -1.0, correct=bool(i % 2), group_id=i,
               mu_logprobs=np.full(5, -4.0, np.float32))
        for i in range(8)
    ]
    write_records(root / "recs", records, vocab_size=128)
    config = config_from_dict({
        "run_dir": str(root / "run"), "seed": 2,
        "model": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                  "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
        "mesh": {"data": 1}, "optim": {"learning_rate": 1e-2},
        "data": {"records": str(root / "recs")},
        "train": {"steps": 2, "batch_size": 4, "max_seq_len": 8, "log_every": 1},
    })
    trainer = Trainer(config, mesh=make_mesh(MeshConfig(data=1), jax.devices()[:1]),
                      progress=False, tensorboard=False)
    result = trainer.run()
    trainer.close()
    return root, result


def test_export_loads_in_transformers_with_our_logits(trained_run, capsys):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, result = trained_run
    out = root / "hf"
    assert cli_main(["export", "--checkpoint", str(root / "run"), "--out", str(out)]) == 0
    assert "exported" in capsys.readouterr().out
    restored = restore_model(root / "run")
    assert restored.step == 2
    # The checkpoint holds the trained parameters (not the initial ones).
    for got, want in zip(jax.tree.leaves(restored.model), jax.tree.leaves(result.state.model())):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    tokens = np.array([[1, 7, 20, 33, 64, 90, 127, 3]], np.int64)
    ours = np.asarray(restored.model.logits(restored.model(tokens.astype(np.int32))))
    hf_model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf_model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-4, rtol=1e-4)

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.decode(tok.encode("12+7=19", add_special_tokens=False)) == "12+7=19"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_token_id


def test_export_is_atomic_and_refuses_to_clobber(trained_run):
    root, _ = trained_run
    out = root / "hf2"
    assert cli_main(["export", "--checkpoint", str(root / "run" / "checkpoints"),
                     "--out", str(out)]) == 0
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="--overwrite"):
        cli_main(["export", "--checkpoint", str(root / "run"), "--out", str(out)])
    assert cli_main(["export", "--checkpoint", str(root / "run" / "checkpoints" / "2"),
                     "--out", str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").read_bytes() == before
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".hf2")]
    assert leftovers == []
    with pytest.raises(FileNotFoundError, match="is not a checkpoint"):
        restore_model(root / "recs")


def test_a_folder_named_export_reads_once_in_the_progress_line(trained_run, capsys):
    # Issue 55 item 16: the bar named the folder after the verb ("export export: 20/20").
    root, _ = trained_run
    assert cli_main(["export", "--checkpoint", str(root / "run"), "--out",
                     str(root / "export")]) == 0
    err = capsys.readouterr().err
    # the tensors the file holds, from its safetensors header (8-byte length, then JSON)
    data = (root / "export" / "model.safetensors").read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    tensors = len([k for k in header if k != "__metadata__"])
    assert "export export" not in err, err
    assert re.search(rf"^export to export/: {tensors}/{tensors} tensors", err, re.M), err
