"""Grain pipeline: record shards -> fixed-shape `Batch`es, shuffled, sharded, checkpointable.

    units [0, U): records, DPO pairs or whole prompt groups (data/units.py), one per loss
    (`LossSpec.needs_pairs` / `needs_groups`); a too-long record: error, or its unit dropped
      -> padded to M = ceil(U / P) * P slots so every process gets the same count
      -> per epoch e, slot j of process p reads index_shuffle(p + j·P, M−1, seed + e)
         (a stateless Feistel permutation: the processes' slots partition each epoch)
      -> decode + validate (threads) -> collate B rows, padded to the smallest bucket length
      -> background-thread prefetch

Slots ≥ U are padding units (`record_mask = 0`, all masks 0), so multi-host processes always
step in lockstep. Everything before the iterator is a grain `MapDataset` indexed by position,
so `get_state()` is a position and `set_state()` resumes at exactly the next unit.

Packing (`pack=True`, data/batch.py's packed layout): rows are `max_len` long (no buckets)
and hold up to k = `records_per_row` records, with `batch_size · k` record slots per batch.

    epoch e, process p: its shuffled record stream (the same `_slot` order, padding skipped)
      -> `pack_batches`: greedy first-fit over the batch's rows (≤ k records and ≤ max_len
         tokens per row); a unit (record or group) that does not fit whole closes the batch
      -> every process computes every process's plan (deterministic in lengths, seed and
         process count) and pads its own with all-padding batches to the longest, so the
         processes stay in lockstep
      -> grain `MapDataset` over batch indices of the concatenated epoch plans (computed
         lazily, so num_epochs=None works); `get_state()` is the next batch index.

Row alignment (data/batch.py): a record's tokens `x = prompt + completion` (length L) give a
row of length L−1 with `inputs = x[:-1]`, `targets = x[1:]`; completion token j is the target
at position P−1+j, where the per-token log-prob arrays are placed and `loss_mask` is 1 if
the model sampled it (a multi-turn episode's environment tokens: 0, `data/collate.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import threading
from typing import Any, Literal

import grain
import jax
import numpy as np
from grain.experimental import ThreadPrefetchIterDataset, index_shuffle

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.data.batch import Batch
from jaxrl_llm.data.collate import _padding_row, collate, collate_packed, record_row
from jaxrl_llm.data.records import RecordError
from jaxrl_llm.data.shards import RecordSource
from jaxrl_llm.data.stages import stage_input
from jaxrl_llm.data.units import (
    BatchShapeError,
    check_group_batch,
    group_counts,
    group_units,
    pack_batches,
    record_units,
    unit_padding,
)

_SHUFFLE_ROUNDS = 4
_PLAN_CACHE_EPOCHS = 3  # epoch plans kept in memory (prefetch threads may straddle epochs)
__all__ = ["BatchLoader", "BatchShapeError", "LoaderOptions", "collate", "collate_packed",
           "loader_from_config", "make_loader", "pack_batches", "packing_options", "record_row"]


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    batch_size: int
    max_len: int  # longest row (prompt + completion − 1) a batch may hold
    buckets: tuple[int, ...] = ()  # static row lengths; () = just max_len
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None  # None = repeat forever
    too_long: Literal["error", "drop"] = "error"
    require_mu: bool = False  # error when a record has no mu_logprobs (not yet scored)
    require_ref: bool = False  # error when a record has no ref_logprobs (never zero-filled)
    routing: bool = False  # batches carry the records' experts (model.routing_replay: sampler)
    process_index: int = 0
    process_count: int = 1
    read_threads: int = 2
    prefetch: int = 2  # batches prepared ahead in a background thread (0 = off)
    pairs: bool = False  # DPO data from `curate` strategy "dpo": rows (2i, 2i+1) are one pair
    groups: bool = False  # whole prompt groups are the shuffle unit (data/units.py)
    pack: bool = False  # several records per max_len row (segment ids); see module docstring
    records_per_row: int = 8  # k, with pack: record slots per row

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.max_len <= 0:
            raise ValueError(f"batch_size and max_len must be > 0, got {self.batch_size}, {self.max_len}")
        if not 0 <= self.process_index < self.process_count:
            raise ValueError(f"process_index {self.process_index} not in [0, {self.process_count})")
        if self.buckets and (max(self.buckets) != self.max_len or min(self.buckets) <= 0):
            raise ValueError(f"buckets {self.buckets} must be positive and end at max_len={self.max_len}")
        if self.pairs and self.batch_size % 2:
            raise ValueError(f"pairs=True needs an even batch_size, got {self.batch_size}")
        if self.num_epochs is not None and self.num_epochs <= 0:
            raise ValueError(f"num_epochs must be > 0 or None, got {self.num_epochs}")
        if self.records_per_row <= 0:
            raise ValueError(f"records_per_row must be > 0, got {self.records_per_row}")
        if self.pairs and self.groups:
            raise ValueError("pairs=True and groups=True exclude each other (no loss needs both)")
        if self.pack and self.pairs:
            raise ValueError("pack=True cannot hold DPO pairs (pairs=True): pair_index holds row "
                             "numbers (data.pack with loss.name dpo/rpo)")
        if self.pack and self.buckets:
            raise ValueError(f"pack=True rows are max_len={self.max_len} long; buckets {self.buckets} "
                             "would be ignored: unset them")

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.buckets))) if self.buckets else (self.max_len,)


class BatchLoader:
    """Iterator of `Batch`es with exact, checkpointable position.

    - `next(loader)` -> `Batch` (numpy arrays; the trainer device-puts them);
    - `get_state()` / `set_state(state)`: JSON-able dict, resume at exactly the next record
      (packed: the next batch);
    - `checkpoint_save()` / `checkpoint_restore()`: `grain.checkpoint` args for an orbax
      `Composite` next to the train state;
    - `dropped_too_long`, `num_records`: counts for the logs;
    - `slot_indices(epoch)`, `batches_in_epoch(epoch)`, `packed_plan(epoch)`: the plan.
    """

    def __init__(self, directory: str, options: LoaderOptions) -> None:
        self.options = o = options
        self.source = RecordSource(directory)
        self._row_len = row_len = self.source.lengths().sum(axis=1) - 1
        if o.pairs and len(self.source) % 2:
            raise RecordError(f"{directory}: pairs=True needs an even number of records, got {len(self.source)}")
        self.group_sizes: dict[int, int] | None = None  # groups=True: records per group id
        if o.groups:
            group_ids = self.source.group_ids()
            ids, sizes = np.unique(group_ids, return_counts=True)
            self.group_sizes = dict(zip(ids.tolist(), sizes.tolist()))
            units = group_units(group_ids)
        else:  # a unit is a record, or a DPO pair
            units = record_units(len(self.source), 2 if o.pairs else 1)
        too_long = np.flatnonzero(row_len > o.max_len)
        if too_long.size and o.too_long == "error":
            i = int(too_long[0])
            raise RecordError(
                f"{self.source.where(i)}: record needs a row of {int(row_len[i])} tokens > max_len "
                f"{o.max_len} ({too_long.size} such records; raise train.max_seq_len, or set "
                "data.too_long=drop to skip them)"
            )
        real = units >= 0
        fits = ((row_len[np.maximum(units, 0)] <= o.max_len) | ~real).all(axis=1)
        # A too-long record drops its whole unit (its pair or group).
        self.dropped_too_long = int(real[~fits].sum())
        if self.dropped_too_long:
            logging.getLogger(__name__).warning(
                "%s: dropping %d of %d records: longer than max_len=%d, or in a pair/group with "
                "such a record (data.too_long=drop)",
                directory, self.dropped_too_long, len(self.source), o.max_len)
        self._units = units[fits]
        self.num_records = int((self._units >= 0).sum())
        if self.num_records == 0:
            raise RecordError(f"{directory}: no records to load (dropped {self.dropped_too_long} too long)")
        if o.groups and o.pack:  # every group must fit one packed batch (fail now, not mid-epoch)
            for unit in self._units:
                pack_batches(row_len[unit[unit >= 0]], rows=o.batch_size, max_len=o.max_len,
                             records_per_row=o.records_per_row, unit_sizes=[int((unit >= 0).sum())])
        if o.groups and not o.pack:
            check_group_batch(o.batch_size, self._units)
            if unit_padding(self._units) > 0:
                logging.getLogger(__name__).warning(
                    "%s: groups differ in size; %.0f%% of the rows of whole-group batches are "
                    "padding", directory, 100 * unit_padding(self._units))
        n_units, p = len(self._units), o.process_count
        self.slots_per_epoch = math.ceil(n_units / p) * p
        self.per_process = self.slots_per_epoch // p  # units (records or pairs) per process and epoch

        if o.pack:
            # Lazily computed epoch plans, shared by grain's reader threads.
            self._lock = threading.RLock()
            self._epoch_counts: dict[int, int] = {}
            self._plans: dict[int, np.ndarray] = {}
            self.batches_per_epoch = None  # varies per epoch: `batches_in_epoch(e)`
            total = (sys.maxsize if o.num_epochs is None
                     else sum(self.batches_in_epoch(e) for e in range(o.num_epochs)))
            ds = grain.MapDataset.range(total).map(self._packed_batch)
            it = ds.to_iter_dataset(grain.ReadOptions(num_threads=o.read_threads,
                                                      prefetch_buffer_size=2 * o.read_threads))
        else:
            units_per_batch = o.batch_size // self._units.shape[1]
            self.batches_per_epoch = math.ceil(self.per_process / units_per_batch)
            ds = grain.MapDataset.range(self.per_process).repeat(o.num_epochs)
            ds = ds.map_with_index(lambda i, _: self._slot(i)).map(self._load)
            it = ds.to_iter_dataset(grain.ReadOptions(num_threads=o.read_threads,
                                                      prefetch_buffer_size=4 * o.batch_size))
            it = it.batch(units_per_batch, batch_fn=lambda units: collate(
                [row for unit in units for row in unit], o.batch_size, o.lengths, pairs=o.pairs))
        if o.prefetch:
            it = ThreadPrefetchIterDataset(it, prefetch_buffer_size=o.prefetch)
        self._iterator = iter(it)

    def _slot(self, position: int, process: int | None = None) -> int:
        """Unit index (into the kept units) for `process`'s (default: this one's) `position`,
        or −1 = padding."""
        o = self.options
        process = o.process_index if process is None else process
        epoch, j = divmod(position, self.per_process)
        slot = process + j * o.process_count
        if o.shuffle:
            slot = int(index_shuffle(slot, max_index=self.slots_per_epoch - 1, seed=o.seed + epoch,
                                     rounds=_SHUFFLE_ROUNDS))
        return slot if slot < len(self._units) else -1

    def _epoch_slots(self, epoch: int, process: int | None = None) -> np.ndarray:
        """`_slot` of every position of `process` in `epoch`, in order."""
        start = epoch * self.per_process
        return np.fromiter((self._slot(i, process) for i in range(start, start + self.per_process)),
                           np.int64, self.per_process)

    def _record_row(self, index: int) -> dict[str, Any]:
        return record_row(self.source[index], require_mu=self.options.require_mu,
                          require_ref=self.options.require_ref, where=self.source.where(index),
                          routing=self.options.routing)

    def _load(self, slot: int) -> list[dict[str, Any]]:
        k = self._units.shape[1]
        if slot < 0:
            return [_padding_row() for _ in range(k)]
        rows = [self._record_row(i) if i >= 0 else _padding_row() for i in self._units[slot].tolist()]
        if self.options.pairs:
            a, b = (self.source.where(i) for i in self._units[slot].tolist())
            if not (rows[0]["correct"] and not rows[1]["correct"] and rows[0]["group_id"] == rows[1]["group_id"]):
                raise RecordError(f"{a} / {b}: not a (correct, incorrect) pair of one group (pairs=True "
                                  "needs records written by `curate` with strategy 'dpo')")
        return rows

    # -- packing ---------------------------------------------------------------------------

    def _stream(self, epoch: int, process: int) -> tuple[np.ndarray, np.ndarray]:
        """(record indices `process` reads in `epoch` in order, padding skipped; the number
        of records of each unit, which packing keeps together)."""
        slots = self._epoch_slots(epoch, process)
        units = self._units[slots[slots >= 0]]
        return units[units >= 0], (units >= 0).sum(axis=1)

    def _process_plan(self, epoch: int, process: int) -> np.ndarray:
        """`process`'s own packing of `epoch`: [n, batch_size, k] record indices (−1 = empty)."""
        o = self.options
        stream, unit_sizes = self._stream(epoch, process)
        pos = pack_batches(self._row_len[stream], rows=o.batch_size, max_len=o.max_len,
                           records_per_row=o.records_per_row, unit_sizes=unit_sizes)
        return np.where(pos >= 0, stream[np.maximum(pos, 0)], -1)

    def _epoch_plan(self, epoch: int) -> np.ndarray:
        """This process's plan of `epoch`, padded with empty batches to the lockstep count."""
        with self._lock:
            plan = self._plans.get(epoch)
            if plan is not None:
                return plan
            plans = [self._process_plan(epoch, p) for p in range(self.options.process_count)]
            count = max(len(x) for x in plans)
            own = plans[self.options.process_index]
            pad = np.full((count - len(own), *own.shape[1:]), -1, own.dtype)
            plan = np.concatenate([own, pad])
            self._epoch_counts[epoch] = count
            self._plans[epoch] = plan
            for old in sorted(self._plans)[:-_PLAN_CACHE_EPOCHS]:
                del self._plans[old]
            return plan

    def batches_in_epoch(self, epoch: int) -> int:
        """Batches every process yields in `epoch` (packed: the max over the processes' plans)."""
        if not self.options.pack:
            return self.batches_per_epoch
        with self._lock:
            if epoch not in self._epoch_counts:
                self._epoch_plan(epoch)
            return self._epoch_counts[epoch]

    def packed_plan(self, epoch: int) -> np.ndarray:
        """Packed: [batches_in_epoch, batch_size, k] record indices of `epoch` (−1 = empty)."""
        if not self.options.pack:
            raise ValueError("packed_plan: this loader does not pack (pack=False)")
        return self._epoch_plan(epoch).copy()

    def _locate(self, index: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of the loader's `index`-th batch."""
        epoch = 0
        while index >= (n := self.batches_in_epoch(epoch)):
            index -= n
            epoch += 1
        return epoch, index

    def _packed_batch(self, index: int) -> Batch:
        o = self.options
        epoch, b = self._locate(index)
        rows = [[self._record_row(int(r)) for r in row if r >= 0] for row in self._epoch_plan(epoch)[b]]
        return collate_packed(rows, o.batch_size, o.max_len, o.records_per_row)

    # -- iteration and state ---------------------------------------------------------------

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> Batch:
        return next(self._iterator)

    def get_state(self) -> dict[str, Any]:
        return self._iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._iterator.set_state(state)

    def checkpoint_save(self) -> Any:
        return grain.checkpoint.CheckpointSave(self._iterator)

    def checkpoint_restore(self) -> Any:
        return grain.checkpoint.CheckpointRestore(self._iterator)

    def group_counts(self, batch: Batch) -> dict[str, float]:
        """`data/whole_groups` and `data/partial_groups` of `batch` (groups=True): groups
        holding all of their records of the data set, and split ones (should be 0)."""
        if self.group_sizes is None:
            return {}
        whole, partial = group_counts(batch.group_ids, batch.record_mask, self.group_sizes)
        return {"data/whole_groups": float(whole), "data/partial_groups": float(partial)}

    def slot_indices(self, epoch: int = 0) -> np.ndarray:
        """Record indices this process reads in `epoch`, in order (−1 = padding row; packed:
        in record-slot order of the epoch's batches, −1 = empty slot)."""
        if self.options.pack:
            return self._epoch_plan(epoch).reshape(-1).copy()
        slots = self._epoch_slots(epoch)
        rows = self._units[np.maximum(slots, 0)]
        return np.where(slots[:, None] >= 0, rows, -1).reshape(-1)


def make_loader(directory: str, *, batch_size: int, max_len: int, **kwargs: Any) -> BatchLoader:
    """`BatchLoader(directory, LoaderOptions(batch_size=…, max_len=…, …))`."""
    return BatchLoader(directory, LoaderOptions(batch_size=batch_size, max_len=max_len, **kwargs))


def loader_from_config(config: Any, directory: str | None = None, *, process_index: int | None = None,
                       process_count: int | None = None, num_epochs: int | None = None) -> BatchLoader:
    """The trainer's loader for an `ExperimentConfig`: per-process rows of the global batch.

    `directory` defaults to what `train` reads (`data.stages.stage_input`: data.curated when
    set, else the scored records, else data.records); process index/count default to
    `jax.process_index()/process_count()`, and each process loads `train.batch_size / count`
    rows (the local part of the global batch). What the loss needs comes from its `LossSpec`:
    μ (`needs_mu`, with loss.mu_source=trainer), DPO pairs (`needs_pairs`), whole groups
    (`needs_groups`).
    """
    d, t = config.data, config.train
    spec = config.loss.spec
    directory = stage_input(config, "train", directory)
    pidx = jax.process_index() if process_index is None else process_index
    pcount = jax.process_count() if process_count is None else process_count
    if t.batch_size % pcount:
        raise ConfigError(f"train.batch_size={t.batch_size} must divide by the {pcount} processes")
    buckets = tuple(d.buckets) if d.buckets else ()
    if buckets and max(buckets) != t.max_seq_len:
        raise ConfigError(f"data.buckets={list(buckets)} must end at train.max_seq_len={t.max_seq_len}")
    try:
        return BatchLoader(directory, LoaderOptions(
            batch_size=t.batch_size // pcount, max_len=t.max_seq_len, buckets=buckets,
            seed=d.shuffle_seed, num_epochs=num_epochs if num_epochs is not None else d.num_epochs,
            too_long=d.too_long, require_mu=config.loss.mu_source == "trainer" and spec.needs_mu,
            require_ref=spec.needs_ref and t.ref_logprobs == "batch",
            routing=config.model.routing_replay == "sampler",
            process_index=pidx, process_count=pcount, read_threads=d.read_threads,
            prefetch=d.prefetch, pairs=spec.needs_pairs, groups=spec.needs_groups,
            **packing_options(config),
        ))
    except BatchShapeError as err:
        per = f" ({t.batch_size // pcount} rows on each of {pcount} processes)" if pcount > 1 else ""
        fix = ("a larger train.batch_size, data.records_per_row or train.max_seq_len" if d.pack
               else "train.batch_size to a multiple of the group size (or curate equal-size groups)")
        raise ConfigError(f"train.batch_size={t.batch_size}{per}: loss.name={config.loss.name} "
                          f"needs whole groups in a batch, but {err}; set {fix}") from err


def packing_options(config: Any) -> dict[str, Any]:
    """`LoaderOptions` packing fields from `data.pack` / `data.records_per_row` (a validated
    `ExperimentConfig` already refuses packing for the pair losses)."""
    d = config.data
    return {"pack": d.pack, "records_per_row": d.records_per_row}
