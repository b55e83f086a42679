"""JAX-backend generation -> records, the score pass, gold SFT records, vLLM conversion, CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.data.shards import RecordSource, read_manifest, read_records
from jaxrl_llm.generate.completions import gold_records
from jaxrl_llm.generate.jax_backend import generate_records
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.models.tokenizer import char_tokenizer
from jaxrl_llm.tasks import get_task
from jaxrl_llm.train.score import score_records
from tests.xla_flags import ONE_DEVICE


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = char_tokenizer()
    config = DecoderConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                           num_heads=2, num_kv_heads=1, tie_embeddings=True)
    model = Decoder(config, rngs=nnx.Rngs(0))
    task = get_task("arithmetic", max_ops=2)
    problems = task.load(num=3)
    root = tmp_path_factory.mktemp("gen")
    generate_records(model, tokenizer, task, problems, str(root / "gen"), n=2, temperature=1.0,
                     top_k=0, max_new_tokens=8, batch_size=2, seed=0, records_per_shard=2,
                     chunk_prompts=2, progress=False)
    return model, tokenizer, task, problems, root


def test_generated_records_carry_prompts_groups_rewards_and_logprobs(setup):
    _, tokenizer, task, problems, root = setup
    records = read_records(root / "gen")
    assert len(records) == 6
    assert sorted(r.group_id for r in records) == [0, 0, 1, 1, 2, 2]
    for r in records:
        problem = problems[r.group_id]
        assert tokenizer.decode(r.prompt_ids.tolist()) == task.prompt(problem)
        assert r.completion_text == tokenizer.decode(r.completion_ids.tolist(), skip_special_tokens=True)
        expected = task.score(problem, r.completion_text)
        assert (r.reward, r.correct, r.invalid) == (expected.reward, expected.correct, expected.invalid)
        assert r.behavior_logprobs.shape == r.completion_ids.shape and (r.behavior_logprobs <= 0).all()
        assert r.metadata["gold"] == problem.answer
    m = read_manifest(root / "gen")
    assert (m.num_records, m.num_groups, m.sampling.backend, m.sampling.n) == (6, 3, "jax", 2)
    assert m.vocab_size == 128 and len(m.shards) == 3


def test_score_matches_the_samplers_untruncated_logprobs_and_resumes(setup):
    model, *_, root = setup
    metrics = score_records(model, str(root / "gen"), str(root / "scored"), batch_size=4, progress=False)
    scored = read_records(root / "scored")
    for r in scored:
        # Two implementations: the KV-cache sampler's log_softmax(logits / T) and the chunked
        # trainer kernel on a full forward pass.
        np.testing.assert_allclose(r.mu_logprobs, r.raw_logprobs, atol=2e-5)
    assert metrics["mismatch/mean_abs_logprob_diff"] < 2e-5
    assert abs(metrics["mismatch/kl_sampler_trainer"]) < 1e-6
    assert metrics["mismatch/ess_fraction"] == pytest.approx(1.0, abs=1e-4)
    assert read_manifest(root / "scored").scored_by == "policy"
    # Resume: remove one finished shard and the manifest; only that shard is recomputed.
    (root / "scored" / "records-00001.array_record").unlink()
    (root / "scored" / "manifest.json").unlink()
    again = score_records(model, str(root / "gen"), str(root / "scored"), batch_size=4, progress=False)
    assert again["score/skipped_shards"] == 2.0 and again["mismatch/num_sequences"] == 2.0
    for a, b in zip(scored, read_records(root / "scored")):
        np.testing.assert_array_equal(a.mu_logprobs, b.mu_logprobs)


def test_gold_records_are_correct_sft_records():
    tokenizer = char_tokenizer()
    for name in ("arithmetic", "countdown", "gsm8k"):
        task = get_task(name)
        problems = task.load(num=4)
        records = gold_records(task, problems, tokenizer, eos_token_id=tokenizer.eos_token_id)
        assert len(records) == 4 and all(r.correct and r.reward == (2.0 if name == "countdown" else 1.0) for r in records)
        assert all(r.completion_ids[-1] == tokenizer.eos_token_id for r in records)
        assert tokenizer.decode(records[0].completion_ids[:-1].tolist()) == task.gold_completion(problems[0])


def test_verify_task_from_records(tmp_path):
    from jaxrl_llm.data.records import Record
    from jaxrl_llm.data.shards import write_records

    recs = [Record([1], [2], reward=1.0, correct=True, completion_text="x = 3. The answer is 3.",
                   metadata={"question": "What is 1 + 2?"}),
            Record([1], [2], reward=-1.0, correct=False, completion_text="The answer is 4.",
                   metadata={"question": "What is 1 + 2?"}),
            Record([1], [2], reward=-1.0, invalid=True, metadata={"question": "q"})]
    write_records(tmp_path, recs)
    task = get_task("verify", path=str(tmp_path))
    problems = task.load()
    assert [p.answer for p in problems] == ["correct", "incorrect"]  # invalid skipped
    assert "The answer is 4." in task.prompt(problems[1]) and "What is 1 + 2?" in task.prompt(problems[1])
    assert task.score(problems[1], "The verdict is incorrect").reward == 1.0
    assert task.score(problems[0], "The verdict is incorrect").reward == -1.0
    assert task.score(problems[0], "no idea").invalid


def test_vllm_output_conversion_on_real_vllm_classes():
    vllm_outputs = pytest.importorskip(
        "vllm.outputs", reason="vllm is an optional GPU extra (pip install jaxrl_llm[vllm]); not installed here")
    from vllm.logprobs import Logprob

    from jaxrl_llm.generate.vllm import completions_from_request_outputs

    sample = vllm_outputs.CompletionOutput(
        index=0, text="ab", token_ids=[5, 6], cumulative_logprob=-0.7,
        logprobs=[{5: Logprob(-0.5), 9: Logprob(-1.0)}, {6: Logprob(-0.2)}], finish_reason="stop")
    request = vllm_outputs.RequestOutput(request_id="0", prompt="p", prompt_token_ids=[1, 2], prompt_logprobs=None,
                                         outputs=[sample], finished=True)
    (c,) = completions_from_request_outputs([request])
    np.testing.assert_array_equal(c.token_ids, [5, 6])
    np.testing.assert_allclose(c.logprobs, [-0.5, -0.2])
    assert c.finish_reason == "stop" and c.raw_logprobs is None


def test_data_cli_stats_show_export(setup, capsys, tmp_path):
    from jaxrl_llm.cli import main

    *_, root = setup
    assert main(["data", "stats", str(root / "gen")]) == 0
    stats = json.loads(capsys.readouterr().out)
    records = read_records(root / "gen")
    assert stats["num_records"] == 6 and stats["num_groups"] == 3
    assert stats["correct_fraction"] == np.mean([r.correct for r in records])
    assert main(["data", "show", str(root / "gen"), "--num", "1"]) == 0
    assert "records-00000.array_record[0]" in capsys.readouterr().out
    out = tmp_path / "x.jsonl"
    assert main(["data", "export-jsonl", str(root / "gen"), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["completion_ids"] for row in rows] == [r.completion_ids.tolist() for r in RecordSource(root / "gen")]
    assert main(["data", "stats", str(tmp_path / "missing")]) == 2
    assert "no manifest.json" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["generate_topr_gsm8k", "generate_topr_math", "generate_fpa_math",
                                  "generate_cpu_arithmetic"])
def test_generate_configs_validate_and_match_the_papers(name):
    from pathlib import Path

    from jaxrl_llm.config import load_config

    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml"
    g = load_config(path).generate
    if "topr" in name:  # 000 §4.1
        assert (g.temperature, g.top_p, g.top_k, g.max_new_tokens) == (1.0, 1.0, 500, 512)
        assert g.n == (16 if "gsm8k" in name else 32)
    if "fpa" in name:  # 002
        assert (g.temperature, g.n) == (0.7, 8)


def test_score_sharded_over_8_devices_equals_one_device(setup):
    import jax

    model, *_, root = setup
    devices = jax.devices()
    assert len(devices) == 8  # tests/conftest.py: 8 fake CPU devices
    score_records(model, str(root / "gen"), str(root / "scored8"), batch_size=8, devices=devices, progress=False)
    score_records(model, str(root / "gen"), str(root / "scored1"), batch_size=8, progress=False)
    for a, b in zip(read_records(root / "scored8"), read_records(root / "scored1"), strict=True):
        np.testing.assert_allclose(a.mu_logprobs, b.mu_logprobs, atol=1e-6)
        np.testing.assert_allclose(a.mu_logprobs, a.raw_logprobs, atol=2e-5)


def test_cli_gold_then_curate(tmp_path, capsys):
    from jaxrl_llm.cli import main

    gold = tmp_path / "gold"
    common = ["data.task=countdown", "data.num_prompts=5"]
    assert main(["generate", "--gold", "--out", str(gold), *common]) == 0
    records = read_records(gold)
    assert len(records) == 5 and all(r.correct and r.reward == 2.0 for r in records)
    capsys.readouterr()
    assert main(["curate", "--records", str(gold), "--out", str(tmp_path / "c"), "data.curation=uniform",
                 "data.num_records=3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["num_records"], report["positives"]) == (3, 3)
    assert main(["curate", "--records", str(gold), "--out", str(tmp_path / "d"), "data.curation=bogus"]) == 2
    assert "unknown curation 'bogus'" in capsys.readouterr().err


# -- the score pass on the training mesh, and on two processes (SPEC §0) --------------------


def naive_mu(model, record, temperature: float) -> np.ndarray:
    """log_softmax(logits / T) of one unpadded row, gathered at the completion tokens (float64)."""
    tokens = np.concatenate([record.prompt_ids, record.completion_ids])
    n = tokens.size - 1
    hidden = model(tokens[None, :-1], positions=np.arange(n)[None], segment_ids=np.ones((1, n), np.int32))
    logits = np.asarray(model.logits(hidden), np.float64)[0] / temperature
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    p = record.prompt_ids.size
    return logp[np.arange(n), tokens[1:]][p - 1 :]


@pytest.mark.parametrize("shape", [(2, 4, 1), (1, 4, 2)])
def test_score_on_the_training_mesh_equals_naive_logprobs(setup, tmp_path, shape):
    from jaxrl_llm.config import ConfigError, MeshConfig
    from jaxrl_llm.parallel.mesh import make_mesh
    from jaxrl_llm.train.score import make_scorer

    model, *_, root = setup
    mesh = make_mesh(MeshConfig(data=shape[0], fsdp=shape[1], tensor=shape[2]))
    # The trainer's rules: "embed" (d = 32) over fsdp, "vocab" (128) over tensor when > 1.
    embed = make_scorer(model, temperature=0.7, mesh=mesh).params["embed"][...]
    assert tuple(embed.sharding.spec) == (("tensor" if shape[2] > 1 else None), "fsdp")
    assert len(embed.addressable_shards[0].data.reshape(-1)) == 128 * 32 // (shape[1] * shape[2])
    score_records(model, str(root / "gen"), str(tmp_path / "scored"), temperature=0.7, batch_size=8,
                  mesh=mesh, progress=False)
    scored = read_records(tmp_path / "scored")
    assert len(scored) == 6 and read_manifest(tmp_path / "scored").extra["score_temperature"] == 0.7
    for r in scored:
        np.testing.assert_allclose(r.mu_logprobs, naive_mu(model, r, 0.7), atol=1e-5)
    with pytest.raises(ConfigError, match=r"generate.score_batch_size=6 must be a multiple .* = 8"
                       if shape[0] == 2 else r"generate.score_batch_size=6 must be a multiple .* = 4"):
        score_records(model, str(root / "gen"), str(tmp_path / "bad"), batch_size=6, mesh=mesh,
                      progress=False)


SHARD_COUNTS = (3, 1, 4, 2, 3)  # process 0 scores shards 0, 2, 4 (10 records), process 1: 1, 3 (3)


def _write_uneven_shards(directory, records) -> None:
    from jaxrl_llm.data.shards import Manifest, SamplingInfo, write_manifest, write_shard

    directory.mkdir()
    shards, start = [], 0
    for i, count in enumerate(SHARD_COUNTS):
        shards.append(write_shard(directory, f"records-{i:05d}.array_record", records[start : start + count],
                                  vocab_size=128))
        start += count
    write_manifest(directory, Manifest(num_records=len(records), shards=shards, vocab_size=128,
                                       num_groups=len({r.group_id for r in records}),
                                       sampling=SamplingInfo(temperature=1.0)))


def _expected_mismatch(mus, samplers) -> dict[str, float]:
    d = [m.astype(np.float64) - s.astype(np.float64) for m, s in zip(mus, samplers, strict=True)]
    flat = np.concatenate(d)
    lw = np.asarray([x.sum() for x in d])
    w = np.exp(lw - lw.max())
    return {"mismatch/mean_abs_logprob_diff": np.abs(flat).mean(),
            "mismatch/kl_sampler_trainer": (np.exp(flat) - 1 - flat).mean(),
            "mismatch/ess_fraction": w.sum() ** 2 / (w**2).sum() / lw.size,
            "mismatch/num_sequences": float(lw.size)}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_score_disjoint_shards_like_one_process(tmp_path):
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from jaxrl_llm.data.shards import write_shard

    from .helpers import make_records
    from .score_mp_worker import tiny_decoder

    records = [r.replace(mu_logprobs=None)
               for r in make_records(sum(SHARD_COUNTS), seed=1, vocab=128, max_prompt=10, max_completion=30)]
    src, full, resume = tmp_path / "records", tmp_path / "full", tmp_path / "resume"
    _write_uneven_shards(src, records)
    # Single-process reference (one device), and μ derived independently for the metrics.
    ref_metrics = score_records(tiny_decoder(), str(src), str(tmp_path / "ref"), batch_size=4, progress=False)
    ref = read_records(tmp_path / "ref")
    # Resume: process 1's shard 1 is already finished, with recognisable μ.
    resume.mkdir()
    write_shard(resume, "records-00001.array_record",
                [r.replace(mu_logprobs=np.full(r.completion_ids.size, -0.5, np.float32)) for r in records[3:4]],
                vocab_size=128)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "XLA_FLAGS": ONE_DEVICE, "PYTHONPATH": str(root)}
    worker = Path(__file__).with_name("score_mp_worker.py")
    procs = [subprocess.Popen([sys.executable, str(worker), str(port), str(i), str(tmp_path / f"p{i}.json"),
                               str(src), str(full), str(src), str(resume)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    results = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    assert results[0]["embed_spec"] == ["tensor", "fsdp"]  # parameters sharded over both hosts

    scored = read_records(full)
    assert [r.reward for r in scored] == [float(i) for i in range(len(records))]  # each once, in order
    for got, want in zip(scored, ref, strict=True):
        np.testing.assert_allclose(got.mu_logprobs, want.mu_logprobs, atol=1e-5)
    manifest = read_manifest(full)
    assert [s["count"] for s in manifest.shards] == list(SHARD_COUNTS)
    assert manifest.num_records == len(records) and manifest.scored_by == "policy"
    assert results[0]["runs"][0] == results[1]["runs"][0]  # every process reports the same
    expected = _expected_mismatch([r.mu_logprobs for r in ref], [r.behavior_logprobs for r in records])
    for key, value in expected.items():
        assert results[0]["runs"][0][key] == pytest.approx(value, rel=1e-5), key
        assert ref_metrics[key] == pytest.approx(value, rel=1e-5), key

    again = read_records(resume)
    assert [r.reward for r in again] == [float(i) for i in range(len(records))]
    np.testing.assert_array_equal(again[3].mu_logprobs, -0.5)  # skipped, not recomputed
    for i, (got, want) in enumerate(zip(again, ref, strict=True)):
        if i != 3:
            np.testing.assert_allclose(got.mu_logprobs, want.mu_logprobs, atol=1e-5)
    assert [s["count"] for s in read_manifest(resume).shards] == list(SHARD_COUNTS)
    assert results[0]["runs"][1] == results[1]["runs"][1]
    assert results[0]["runs"][1]["score/skipped_shards"] == 1.0
    assert results[0]["runs"][1]["mismatch/num_sequences"] == len(records) - 1


@pytest.mark.slow
def test_cli_score_on_the_configured_mesh(tmp_path, capsys):
    from jaxrl_llm.cli import main
    from jaxrl_llm.config import load_config
    from jaxrl_llm.train.state import build_model

    gold, out = tmp_path / "gold", tmp_path / "scored"
    common = ["data.task=countdown", "data.num_prompts=4"]
    assert main(["generate", "--gold", "--out", str(gold), *common]) == 0
    mesh = ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]
    capsys.readouterr()
    assert main(["score", "--records", str(gold), "--out", str(tmp_path / "bad"), *common, *mesh,
                 "generate.score_batch_size=6"]) == 2
    assert "generate.score_batch_size=6 must be a multiple of the mesh's data×fsdp = 4" in capsys.readouterr().err
    assert main(["score", "--records", str(gold), "--out", str(out), *common, *mesh,
                 "generate.score_batch_size=4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["output"] == str(out) and report["score/skipped_shards"] == 0.0
    model = build_model(load_config(None, common))  # the CLI's random-init policy (config seed)
    scored = read_records(out)
    assert len(scored) == 4
    for r in scored:
        np.testing.assert_allclose(r.mu_logprobs, naive_mu(model, r, 1.0), atol=1e-5)
