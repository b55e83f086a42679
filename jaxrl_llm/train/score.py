"""The score pass (docs/architecture.md § Why μ is re-scored): μ and π_ref per-token log-probs of every record, trainer numerics.

One forward pass of the initial policy over the records gives, from the same hidden states,
`jaxrl_llm.losses.logprobs.token_logprobs` at the sampling temperature (`logits / T`, with
the model's final-logit softcap) — exactly what the train step computes at step 0, so
π/μ = 1 there — and at temperature 1: the reference log-probs `ref_logprobs` that the
KL/preference losses read with `train.ref_logprobs: batch` (the policy being scored is the
reference). Output mirrors the input's shards; each output shard is written whole and
renamed into place, so an interrupted run resumes by skipping finished shards.

Sharded like training: the parameters are placed on the ("data", "fsdp", "tensor") mesh by
the trainer's logical-axis rules (`parallel.rules`), each call's rows are split over
("data", "fsdp"), and the hidden states and unembedding carry the train step's sharding
constraints (`train.forward.forward`), so a model that only fits sharded (Llama-3-8B on a v5e
pod) scores where it trains.

Multi-host (`jax.process_count() > 1`): input shard i is scored by process i mod P. Every
process feeds its own rows as the process-local part of each global batch and reads back its
own rows; all processes make the same sequence of jitted calls (same count, same row length),
padding with all-padding batches, and write their own output shards. After a barrier process
0 writes the manifest.

When the sampler's log-probs are present the sampler-vs-trainer mismatch is reported
(`train.mismatch`: per-token |Δ log p| and |Δp|, k3 KL, χ², ESS, Pearson correlation of
the log-probs) over all processes' records, identical on every process, and written to the
output manifest; `max_mismatch` flags or drops sequences beyond a bound.

Multi-turn episodes (`Record.action_mask`): the forward pass runs over the whole sequence, so
environment and tool tokens are context, but μ and π_ref are written at model tokens only
(0.0 at environment tokens), and the mismatch counts model tokens only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.core.progress import progress_bar
from jaxrl_llm.core.signals import STOP_SIGNALS, stop_point
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.sampler_info import effective_temperature, manifest_sampler_info
from jaxrl_llm.data.shards import Manifest, RecordSource, write_manifest, write_shard
from jaxrl_llm.sampling.sampler import default_bucket
from jaxrl_llm.train.mismatch import NUM_MISMATCH_STATS, Mismatch, compared_logprobs
from jaxrl_llm.train.scorer import (  # noqa: F401 (re-exported: BATCH_SIZE_KEY, make_scorer, score_batch)
    BATCH_SIZE_KEY,
    REF_TEMPERATURE,
    Scorer,
    default_mesh,
    make_scorer,
    process_rows,
    score_batch,
)

# -- the plan: which process scores what, in lockstep --------------------------------------


@dataclasses.dataclass(frozen=True)
class _Work:
    """One jitted call's worth of one process's records."""

    shard: int  # position in the input manifest's shard list
    indices: tuple[int, ...]  # record indices in the input directory
    length: int  # row length (power-of-two bucket) these records need
    last: bool  # the shard is complete after this batch


@dataclasses.dataclass
class _Plan:
    work: list[_Work]  # this process's batches, in order
    skipped: list[int]  # this process's shards finished by an earlier run
    empty: list[int]  # this process's shards with no records (written without a call)
    records: int  # records this process scores


def _plan(manifest: Manifest, lengths: np.ndarray, out: epath.Path, local_rows: int) -> _Plan:
    """This process's share: input shard i goes to process i mod P; finished shards skipped."""
    counts = [int(s["count"]) for s in manifest.shards]
    starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    row_len = lengths.sum(axis=1) - 1  # model input length of each record (docs/architecture.md § Why μ is re-scored alignment)
    plan = _Plan([], [], [], 0)
    for s in range(jax.process_index(), len(counts), jax.process_count()):
        if (out / manifest.shards[s]["path"]).exists():  # written whole, then renamed: complete
            plan.skipped.append(s)
            continue
        if not counts[s]:
            plan.empty.append(s)
            continue
        plan.records += counts[s]
        for b in range(0, counts[s], local_rows):
            idx = np.arange(starts[s] + b, min(starts[s] + b + local_rows, starts[s + 1]))
            plan.work.append(_Work(s, tuple(int(i) for i in idx), default_bucket(int(row_len[idx].max())),
                                   b + local_rows >= counts[s]))
    return plan


def _allgather(x: np.ndarray) -> np.ndarray:
    """[P, ...]: `x` of every process (same shape on all), stacked in process order."""
    return np.asarray(multihost_utils.process_allgather(x))


def _lockstep_lengths(own: list[int]) -> list[int]:
    """Row length of every jitted call, identical on all processes: the longest any process
    needs at that call; calls beyond a process's own work are all-padding batches."""
    if jax.process_count() == 1:
        return own
    n = int(_allgather(np.int32(len(own))).max())
    if not n:
        return []
    mine = np.zeros(n, np.int32)
    mine[: len(own)] = own
    return [int(x) for x in _allgather(mine).max(axis=0)]


def _global_stats(local: np.ndarray) -> np.ndarray:
    """[P, k] float64 statistics of every process, exact: shipped as uint32 bit patterns
    because jax (without x64) would round float64 to float32."""
    local = np.ascontiguousarray(local, np.float64)
    if jax.process_count() == 1:
        return local[None]
    bits = _allgather(local.view(np.uint32))
    return np.ascontiguousarray(bits).view(np.float64).reshape(jax.process_count(), -1)


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# -- the pass ------------------------------------------------------------------------------


def _check_outputs(out: epath.Path, manifest: Manifest) -> None:
    """Every process checks (so all fail alike, none waits for a peer that raised)."""
    missing = [s["path"] for s in manifest.shards if not (out / s["path"]).exists()]
    if missing:
        raise RuntimeError(
            f"score: {out} lacks {len(missing)} output shard(s) after all processes finished "
            f"(first: {missing[0]}); with several processes the output directory must be on a "
            "filesystem they share")


def _shard_count(out: epath.Path, name: str) -> int:
    """Records in output shard `name`, from its lengths sidecar (cheap)."""
    path = out / name.replace(".array_record", ".lengths.npy")
    return int(np.load(io.BytesIO(path.read_bytes())).shape[0])


def _recount(out: epath.Path, manifest: Manifest) -> None:
    """After sequences were dropped: the manifest's shard and record counts from `out` itself
    (resumed shards included, whose drops this run did not see)."""
    manifest.shards = [{"path": s["path"], "count": _shard_count(out, s["path"])} for s in manifest.shards]
    manifest.num_records = sum(s["count"] for s in manifest.shards)
    write_manifest(out, manifest)
    records = list(RecordSource(out, validate=False))
    manifest.num_correct = sum(r.correct for r in records)
    manifest.num_invalid = sum(r.invalid for r in records)
    manifest.num_groups = len({r.group_id for r in records})


def _flag(record: Record, seq_diff: float, bound: float) -> Record:
    """`record` marked as over the mismatch bound (metadata["mismatch"])."""
    return record.replace(metadata={**record.metadata, "mismatch": {
        "seq_logprob_diff": seq_diff, "bound": bound}})


def score_records(
    model: Any,
    in_dir: str,
    out_dir: str,
    *,
    temperature: float | None = None,
    batch_size: int = 8,
    chunk_size: int = 4096,
    model_name: str = "",
    progress: bool = True,
    mesh: Mesh | None = None,
    devices: Sequence[Any] | None = None,
    max_mismatch: float | None = None,
    drop_mismatched: bool = False,
    routing_replay: bool = False,
) -> dict[str, float]:
    """Write `in_dir`'s records with `mu_logprobs` and `ref_logprobs` to `out_dir`; returns
    the sampler-vs-trainer mismatch metrics (`train.mismatch.Mismatch`).

    `mu_logprobs` are at `temperature` (None: the manifest's sampling temperature; greedy
    data: 1), `ref_logprobs` at T = 1 (`REF_TEMPERATURE`), from the same forward pass of
    `model` — the initial policy, i.e. the reference of the KL/preference losses.
    `max_mismatch` (`generate.max_mismatch`, nats) flags records whose |Σ log μ_trainer −
    Σ log μ_sampler| exceeds it (`metadata["mismatch"]`), or with `drop_mismatched`
    (`generate.drop_mismatched`) leaves them out; the counts are in the metrics.
    `routing_replay` (`model.routing_replay: sampler`): μ's forward routes each completion
    token to the experts the record holds (`Record.routing`; docs/moe.md).
    `mesh` (the training mesh, `make_mesh(config.mesh)`) shards parameters and rows like the
    train step; `devices` instead gives a data-parallel mesh over them; neither: one device
    (single process). `batch_size` (`generate.score_batch_size`) is the global rows per call
    and must be a multiple of the mesh's data×fsdp. With several processes every process calls
    this with the same arguments; all return the same metrics. The output manifest says what
    was compared and how the records were sampled (`extra`: `score_temperature`,
    `ref_logprobs`, `sampling_truncated`, `raw_logprobs_temperature`,
    `score_temperature_matches_sampling`, `score_compared`, `score_metrics`).
    """
    source = RecordSource(in_dir)
    manifest = dataclasses.replace(source.manifest)
    if temperature is None:
        temperature = effective_temperature(manifest.sampling.temperature)
    if temperature <= 0:
        raise ValueError(f"score temperature must be > 0, got {temperature}")
    if drop_mismatched and max_mismatch is None:
        raise ConfigError("generate.drop_mismatched=true needs a bound: set generate.max_mismatch "
                          "(nats of |Σ log μ_sampler − Σ log μ_trainer| per sequence)")
    out = epath.Path(out_dir)
    if out.resolve() == epath.Path(in_dir).resolve():
        raise ValueError(f"score: the output directory must differ from the input directory ({in_dir})")
    if mesh is not None and devices is not None:
        raise ValueError("score_records: pass mesh or devices, not both")
    mesh = mesh if mesh is not None else default_mesh(devices)
    local_rows = process_rows(mesh, batch_size)  # fail before placing the parameters
    scorer = Scorer(model, temperature=temperature, chunk_size=chunk_size, mesh=mesh,
                    routing=routing_replay)
    compare = compared_logprobs(manifest, temperature, REF_TEMPERATURE)
    out.mkdir(parents=True, exist_ok=True)
    plan = _plan(source.manifest, source.lengths(), out, local_rows)
    for s in plan.empty:
        write_shard(out, source.manifest.shards[s]["path"], [], vocab_size=manifest.vocab_size)
    lengths = _lockstep_lengths([w.length for w in plan.work])
    if lengths:  # the longest batch compiled first: refused if it would not fit
        scorer.check_memory(batch_size, max(lengths))
    mismatch = Mismatch()
    scored: list[Record] = []
    bar = progress_bar(plan.records, desc="score", unit="record",
                       enabled=progress and jax.process_index() == 0)
    # Ctrl-C / SIGTERM: stop after the batch; complete shards stay and a re-run skips them.
    # Several processes score in lockstep and cannot stop apart: a signal exits at once.
    active = contextlib.ExitStack()
    stop = active.enter_context(stop_point("the current batch (complete shards are kept)",
                                           STOP_SIGNALS if jax.process_count() == 1 else ()))
    try:
        for step, length in enumerate(lengths):
            stop.check("score")
            work = plan.work[step] if step < len(plan.work) else None
            records = source.__getitems__(list(work.indices)) if work is not None else []
            for record, (mu, ref) in zip(records, score_batch(scorer, records, local_rows, length), strict=True):
                record = record.replace(mu_logprobs=mu, ref_logprobs=ref)
                pair = compare.pair(record, mu, ref)
                if pair is not None and pair[0].size:
                    seq_diff = mismatch.add(*pair)
                    if max_mismatch is not None and abs(seq_diff) > max_mismatch:
                        mismatch.count("dropped" if drop_mismatched else "flagged")
                        if drop_mismatched:
                            continue
                        record = _flag(record, seq_diff, max_mismatch)
                scored.append(record)
            bar.update(len(records))
            if work is not None and work.last:
                write_shard(out, source.manifest.shards[work.shard]["path"], scored,
                            vocab_size=manifest.vocab_size)
                scored = []
    finally:
        bar.close()
        active.close()
    stats = _global_stats(np.append(mismatch.stats(), len(plan.skipped)))
    metrics = {**Mismatch.combine(stats[:, :NUM_MISMATCH_STATS]),
               "score/skipped_shards": float(stats[:, NUM_MISMATCH_STATS].sum())}
    _barrier("jaxrl_llm.score: output shards written")
    _check_outputs(out, source.manifest)
    if jax.process_index() == 0:
        manifest.shards = [{"path": s["path"], "count": s["count"]} for s in source.manifest.shards]
        manifest.scored_by = model_name or "policy"
        if drop_mismatched:
            _recount(out, manifest)
        t = manifest.sampling.temperature
        manifest.extra = {
            **manifest.extra, **manifest_sampler_info(manifest),
            "score_temperature": temperature,
            "ref_logprobs": {"temperature": REF_TEMPERATURE, "model": manifest.scored_by},
            # False: μ_trainer is not the distribution the tokens were drawn from.
            "score_temperature_matches_sampling": bool(
                t > 0 and math.isclose(effective_temperature(t), temperature, rel_tol=1e-6)),
            "score_compared": compare.to_json(),
            "score_mismatch_bound": {"max_mismatch": max_mismatch, "drop": drop_mismatched},
            "score_metrics": metrics,
            "score_routing_replay": "sampler" if routing_replay else "off",
        }
        write_manifest(out, manifest)
    _barrier("jaxrl_llm.score: manifest written")  # readers of out_dir on any process see it
    return metrics
