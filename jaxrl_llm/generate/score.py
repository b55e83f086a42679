"""The score pass (SPEC §0): μ per-token log-probs of every record with the trainer's numerics.

One forward pass of the initial policy over the records, computing
`jaxrl_llm.losses.logprobs.token_logprobs` with the sampling temperature (`logits / T`) and
the model's final-logit softcap — exactly what the train step computes at step 0, so
π/μ = 1 there. Output mirrors the input's shards; each output shard is written whole and
renamed into place, so an interrupted run resumes by skipping finished shards.

When the sampler's log-probs are present the sampler-vs-trainer mismatch is reported: mean
|Δ log-prob| per token, a KL(sampler ‖ trainer) estimate (k3 per token), and the effective
sample size of sequence-level weights exp(Σ(log μ − log q)) as a fraction of N.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx
from tqdm.auto import tqdm

from jaxrl_llm.data.loader import collate, record_row
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import RecordSource, write_manifest, write_shard


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << math.ceil(math.log2(max(n, 1))))


@dataclasses.dataclass
class Mismatch:
    """Running sampler-vs-trainer statistics (SPEC §0)."""

    tokens: int = 0
    abs_diff: float = 0.0
    k3: float = 0.0
    seq_log_weights: list[float] = dataclasses.field(default_factory=list)

    def add(self, mu: np.ndarray, sampler: np.ndarray) -> None:
        d = mu.astype(np.float64) - sampler.astype(np.float64)  # log(p/q), p = trainer, q = sampler
        self.tokens += d.size
        self.abs_diff += float(np.abs(d).sum())
        self.k3 += float((np.expm1(d) - d).sum())  # E_q[(r − 1) − log r] = KL(q ‖ p)
        self.seq_log_weights.append(float(d.sum()))

    def metrics(self) -> dict[str, float]:
        if not self.tokens:
            return {}
        lw = np.asarray(self.seq_log_weights)
        w = np.exp(lw - lw.max())
        ess = float(w.sum() ** 2 / (w**2).sum() / lw.size)
        return {"mismatch/mean_abs_logprob_diff": self.abs_diff / self.tokens,
                "mismatch/kl_sampler_trainer": self.k3 / self.tokens,
                "mismatch/ess_fraction": ess, "mismatch/num_sequences": float(lw.size)}


def make_scorer(model: Any, *, temperature: float, chunk_size: int = 4096, devices: Sequence[Any] | None = None):
    """A jitted `(inputs, targets, positions, segment_ids) -> logp [B, T]` for `model`.

    With several `devices` the batch rows are sharded over them (data parallel, parameters
    replicated), as the train step shards its batch; B must divide by the device count.
    """
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxrl_llm.losses.logprobs import token_logprobs

    graphdef, state = nnx.split(model)
    softcap = getattr(model, "final_logit_softcap", None)
    vocab = int(model.unembedding().shape[1])
    chunk = min(chunk_size, vocab)
    rows = None
    if devices is not None and len(devices) > 1:
        mesh = Mesh(np.asarray(devices), ("data",))
        rows = NamedSharding(mesh, PartitionSpec("data"))
        state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))

    @jax.jit
    def score(state, inputs, targets, positions, segment_ids):
        m = nnx.merge(graphdef, state)
        hidden = m(inputs, positions=positions, segment_ids=segment_ids)
        unembed = m.unembedding().astype(hidden.dtype)
        return token_logprobs(hidden, unembed, targets, chunk_size=chunk, temperature=temperature,
                              softcap=softcap)

    def run(*arrays: np.ndarray) -> np.ndarray:
        if rows is not None:
            if arrays[0].shape[0] % len(devices):
                raise ValueError(f"score batch of {arrays[0].shape[0]} rows does not divide over {len(devices)} devices")
            arrays = tuple(jax.device_put(a, rows) for a in arrays)
        return np.asarray(score(state, *map(jnp.asarray, arrays)))

    return run


def score_batch(scorer, records: Sequence[Record], batch_size: int) -> list[np.ndarray]:
    """μ log-probs (one array per record, aligned with its completion)."""
    rows = [record_row(r) for r in records]
    length = _bucket(max(r["inputs"].size for r in rows))
    batch = collate(rows, batch_size, (length,))
    logp = scorer(batch.inputs, batch.targets, batch.positions, batch.segment_ids)
    out = []
    for i, r in enumerate(records):
        p, c = r.prompt_ids.size, r.completion_ids.size
        out.append(logp[i, p - 1 : p - 1 + c].astype(np.float32))
    return out


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
    devices: Sequence[Any] | None = None,
) -> dict[str, float]:
    """Write `in_dir`'s records with `mu_logprobs` to `out_dir`; returns mismatch metrics.

    `temperature=None` uses the manifest's sampling temperature (greedy data: 1).
    `devices` (e.g. `jax.local_devices()`) shards each batch's rows over several devices;
    `batch_size` must divide by their number.
    """
    source = RecordSource(in_dir)
    manifest = dataclasses.replace(source.manifest)
    if temperature is None:
        temperature = manifest.sampling.temperature or 1.0
    if temperature <= 0:
        raise ValueError(f"score temperature must be > 0, got {temperature}")
    out = epath.Path(out_dir)
    if out.resolve() == epath.Path(in_dir).resolve():
        raise ValueError("score: the output directory must differ from the input directory")
    out.mkdir(parents=True, exist_ok=True)
    scorer = make_scorer(model, temperature=temperature, chunk_size=chunk_size, devices=devices)
    mismatch = Mismatch()
    start, skipped = 0, 0
    shards = []
    bar = tqdm(total=len(source), desc="score", unit="rec", disable=not progress)
    for shard in source.manifest.shards:
        count = shard["count"]
        indices = range(start, start + count)
        start += count
        if (out / shard["path"]).exists():  # finished in an earlier run
            shards.append({"path": shard["path"], "count": count})
            skipped += 1
            bar.update(count)
            continue
        scored: list[Record] = []
        for b in range(0, count, batch_size):
            records = source.__getitems__(list(indices[b : b + batch_size]))
            for record, mu in zip(records, score_batch(scorer, records, batch_size)):
                sampler = record.raw_logprobs if record.raw_logprobs is not None else record.behavior_logprobs
                if sampler is not None and sampler.size:
                    mismatch.add(mu, sampler)
                scored.append(record.replace(mu_logprobs=mu))
            bar.update(len(records))
        shards.append(write_shard(out, shard["path"], scored, vocab_size=manifest.vocab_size))
    bar.close()
    metrics = {**mismatch.metrics(), "score/skipped_shards": float(skipped)}
    manifest.shards = shards
    manifest.scored_by = model_name or "policy"
    manifest.extra = {**manifest.extra, "score_temperature": temperature, "score_metrics": metrics}
    write_manifest(out, manifest)
    return metrics
