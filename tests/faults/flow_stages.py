"""Fault-injection stages beyond `train`: generate, score, curate, export and iterate."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

from tests.faults import checks
from tests.faults.harness import Kill, Trigger, when
from tests.faults.stages import (
    CURATED,
    GEN_CONFIG,
    GEN_OVERRIDES,
    GEN_STAGES,
    ITERATE_YAML,
    RECORDS,
    SCORED,
    Reference,
    Stage,
    _glob,
    _trace_reached,
    _train_after_kill,
    _train_final,
)

RECORDS_DETAIL = ("the output holds every record once, equal to the uninterrupted run's (bytes); "
                  "a directory left by the kill is either refused by the reader or already complete")


def _records_stage(name: str, args: list[str], out: Path, inputs: tuple[Path, ...],
                   chosen: Callable[[int], Trigger], *, resumable: bool, detail: str) -> Stage:
    def setup(cwd: Path, root: Path) -> None:
        for d in inputs:
            shutil.copytree(root / "gen" / d, cwd / d)

    def reference(cwd: Path, ref: Reference) -> None:
        ref.data["records"] = checks.record_bytes(cwd / out)
        assert ref.data["records"], f"{name}: the uninterrupted run wrote no records"

    def after_kill(cwd: Path, kill: Kill, ref: Reference) -> list[str]:
        return checks.records_failures(cwd / out, ref.data["records"], "after the kill", partial_ok=True)

    def final(cwd: Path, ref: Reference) -> list[str]:
        return checks.records_failures(cwd / out, ref.data["records"], "after the resume", partial_ok=False)

    # generate and curate restart from scratch; once the manifest is there they are done (a
    # re-run refuses to overwrite without --overwrite). score resumes, skipping whole shards.
    def complete(cwd: Path) -> bool:
        return not resumable and (cwd / out / "manifest.json").exists()

    return Stage(name, args, setup, chosen, after_kill, final, reference, complete, detail, mixed=True)


def _shard_trigger(directory: Path, what: str) -> Callable[[int], Trigger]:
    def chosen(seed: int) -> Trigger:
        k = random.Random(seed).randint(0, 3)
        return when(_glob(f"{directory}/records-{k:05d}.array_record*"), f"when {what} shard {k} appears")
    return chosen


def _curate_trigger(seed: int) -> Trigger:
    pattern, what = [(f"{CURATED}", "its output directory appears"),
                     (f"{CURATED}/records-00000.array_record", "its shard appears"),
                     (f"{CURATED}/*.lengths.npy*", "its lengths file appears")][seed % 3]
    return when(_glob(pattern), f"when {what}")


def _export_trigger(seed: int) -> Trigger:
    pattern, what = [(".hf.tmp-*", "the temporary directory appears"),
                     (".hf.tmp-*/*.safetensors", "the weights file appears"),
                     # config.json, not the tokenizer files: those are written last, just before
                     # the rename and exit, and a poll could no longer catch the process alive
                     (".hf.tmp-*/config.json", "the config file appears")][seed % 3]
    return when(_glob(pattern), f"when {what}")


def _export_stage() -> Stage:
    args = ["export", "--checkpoint", "run", "--out", "hf"]

    def setup(cwd: Path, root: Path) -> None:
        shutil.copytree(root / "train" / "run", cwd / "run")
        shutil.copy(root / "train" / "train.yaml", cwd / "train.yaml")

    def reference(cwd: Path, ref: Reference) -> None:
        ref.data["export"] = checks.tree_bytes(cwd / "hf")
        assert any(k.endswith(".safetensors") for k in ref.data["export"])

    return Stage(
        "export mid-write", args, setup, _export_trigger,
        lambda cwd, kill, ref: checks.export_failures(cwd / "hf", ref.data["export"], "after the kill",
                                                      partial_ok=True),
        lambda cwd, ref: checks.export_failures(cwd / "hf", ref.data["export"], "after the resume",
                                                partial_ok=False),
        reference, lambda cwd: (cwd / "hf").exists(),
        "`hf/` is absent or the uninterrupted export file for file, never partial; the re-run "
        "writes it whole", mixed=True)


# -- iterate -------------------------------------------------------------------------------

IT = Path("it") / "iter_1"
IT_TRAIN = str(IT / "train")
IT_DIRS = {"generate": IT / "records", "score": IT / "scored", "curate": IT / "curated"}


def _stages_done(cwd: Path) -> dict:
    path = cwd / IT / "stages.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _iterate_trigger(seed: int) -> Trigger:
    point = ["generate", "score", "curate", "mid-train", "train"][seed % 5]
    if point == "mid-train":
        return when(_trace_reached(IT_TRAIN, 2), "inside the train stage (step 2)")
    return when(lambda cwd: point in _stages_done(cwd), f"after the {point} stage")


def _iterate_reference(cwd: Path, ref: Reference) -> None:
    _train_reference_at(cwd, ref)
    ref.data["dirs"] = {s: checks.record_bytes(cwd / d) for s, d in IT_DIRS.items()}
    ref.data["export"] = checks.tree_bytes(cwd / IT / "export")


def _train_reference_at(cwd: Path, ref: Reference) -> None:
    """The train stage's reference: its trace, final states and the curated records it reads."""
    ckpts = cwd / IT_TRAIN / "checkpoints"
    ref.data.update({"trace": checks.read_trace(cwd / IT_TRAIN),
                     "records": checks.digests(cwd / IT_DIRS["curate"]),
                     "states": {s: checks.checkpoint_state(ckpts, s)[1]
                                for s in checks.committed_steps(ckpts)}})


def _iterate_after_kill(cwd: Path, kill: Kill, ref: Reference) -> list[str]:
    done, out = _stages_done(cwd), []
    for stage, d in IT_DIRS.items():
        out += checks.records_failures(cwd / d, ref.data["dirs"][stage], f"after the kill ({stage})",
                                       partial_ok=stage not in done)
    if (cwd / IT_TRAIN).exists():
        out += _train_after_kill(cwd, kill, ref, run=IT_TRAIN)
    out += checks.export_failures(cwd / IT / "export", ref.data["export"], "after the kill",
                                  partial_ok="export" not in done)
    return out


def _iterate_final(cwd: Path, ref: Reference) -> list[str]:
    done = _stages_done(cwd)
    out = [] if list(done) == list(GEN_STAGES) else [f"stages.json lists {list(done)}"]
    for stage, d in IT_DIRS.items():
        out += checks.records_failures(cwd / d, ref.data["dirs"][stage], f"after the resume ({stage})",
                                       partial_ok=False)
    out += _train_final(cwd, ref, run=IT_TRAIN)
    out += checks.export_failures(cwd / IT / "export", ref.data["export"], "after the resume",
                                  partial_ok=False)
    rows = [json.loads(x)["step"] for x in (cwd / "it" / "metrics.jsonl").read_text().splitlines()
            if x.strip()]
    if rows != [0]:
        out.append(f"it/metrics.jsonl sample rows at steps {rows}, expected [0] (one per iteration)")
    return out


def _iterate_stage() -> Stage:
    def setup(cwd: Path, root: Path) -> None:
        (cwd / "it.yaml").write_text(ITERATE_YAML)

    return Stage(
        "iterate between stages", ["iterate", "--config", "it.yaml", "--no-progress"], setup,
        _iterate_trigger, _iterate_after_kill, _iterate_final, _iterate_reference,
        detail="after each of generate, score, curate, train (and inside train): every stage "
               "marked done holds the uninterrupted run's output; the re-run completes the rest; "
               "records, scored, curated, export bit-equal, final train state bit-equal, each "
               "record once per epoch in the same order, one sample-metrics row", mixed=True)


def flow_stages() -> list[Stage]:
    gen = ["--config", GEN_CONFIG, *GEN_OVERRIDES]
    return [
        _records_stage("generate mid-generation", ["generate", *gen], RECORDS, (),
                       _shard_trigger(RECORDS, "a record"), resumable=False, detail=RECORDS_DETAIL),
        _records_stage("score mid-score", ["score", *gen], SCORED, (RECORDS,),
                       _shard_trigger(SCORED, "a scored"), resumable=True,
                       detail=f"{RECORDS_DETAIL}; μ and π_ref log-probs bit-equal"),
        _records_stage("curate mid-curate", ["curate", *gen], CURATED, (RECORDS, SCORED),
                       _curate_trigger, resumable=False, detail=RECORDS_DETAIL),
        _export_stage(),
        _iterate_stage(),
    ]

