"""Orbax checkpoints of a training run .

One checkpoint step directory holds three items, saved together by one `CheckpointManager`:

- `state`: the train-state pytree (parameters, optimizer state, step, RNG key data) through
  `StandardSave` — sharded arrays are written by every host in parallel (async by default);
- `data`: the grain iterator position (`grain.checkpoint.CheckpointSave`), so a resumed run
  consumes exactly the records the uninterrupted run would have;
- `meta`: JSON with the step, the resolved config and anything else the caller adds;

and any `blobs` the caller adds, one item of bytes each (the online loop's queued records:
online/queue.py), written by process 0 into the step's temporary directory like `meta`, so
committed with the step or not at all.

What it costs (docs/plan.md, "Disk"): `state` is the float32 parameters, AdamW's two float32 moments
(4 + 4 + 4 = 12 bytes a parameter), the step and the RNG key, plus a frozen reference copy of
the parameters with `train.ref_logprobs: model`; `data` and `meta` are a few kB.
`train.checkpoint_dtype: bfloat16` stores the parameters (and the reference) in bfloat16
(10 bytes a parameter): a restore casts them back to the target's dtype, so a resumed run
starts from rounded weights (not bit-exact; said on stderr). `train.keep_checkpoints`
(default 1) old steps are deleted only once the new one is committed.

A step directory only counts once Orbax has committed it: a process killed mid-save leaves
`<step>.orbax-checkpoint-tmp*`, which `latest_step()` ignores (the previous step restores).
Restoring takes an abstract target (`jax.ShapeDtypeStruct`s with shardings), so a checkpoint
restores onto any mesh shape — Orbax reshards on read.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from jaxrl_llm.config import ExperimentConfig, MeshConfig
from jaxrl_llm.core.paths import PathLike, as_path
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.train.state import abstract_train_state
from jaxrl_llm.train.state_items import state_items, with_items

STATE, DATA, META = "state", "data", "meta"
# The state items `params_dtype` applies to: the policy's weights and the frozen reference.
PARAM_ITEMS = ("params", "ref_params")
PARAMS_DTYPE = "params_dtype"  # meta key: the dtype the parameters were stored in

# Orbax splits a replicated array's write across its replicas, compiling one slice program
# per device and shape on the first save: worth it for large arrays only.
REPLICA_PARALLEL_MIN_BYTES = 1 << 20
_handler_registered = False


def _register_array_handler() -> None:
    """Replace Orbax's default jax.Array handler by one with our replica-parallel threshold,
    once per process. The replacement is deliberate, so it goes through the registry's
    `add(..., ignore_warnings=True)`: `register_type_handler(override=True)` logs an absl
    "Type handler registry ... overriding jax.Array" warning on every checkpointing command."""
    global _handler_registered
    if _handler_registered:
        return
    handler = ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES)
    try:
        from orbax.checkpoint._src.serialization.type_handler_registry import (
            GLOBAL_TYPE_HANDLER_REGISTRY,
        )
    except ImportError:  # another Orbax layout: the public call (it logs the warning)
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    else:
        GLOBAL_TYPE_HANDLER_REGISTRY.add(jax.Array, handler, override=True, ignore_warnings=True)
    _handler_registered = True


class _BytesHandler(ocp.CheckpointHandler):
    """One item of bytes: a file that process 0 writes into the item's directory (Orbax
    creates it inside the step's temporary directory and commits it with the step)."""

    FILE = "bytes"

    def save(self, directory: epath.Path, args: BytesSave) -> None:
        if jax.process_index() == 0:
            (directory / self.FILE).write_bytes(args.data)

    def restore(self, directory: epath.Path, args: BytesRestore | None = None) -> bytes:
        return (directory / self.FILE).read_bytes()


@ocp.args.register_with_handler(_BytesHandler, for_save=True)
@dataclass
class BytesSave(ocp.args.CheckpointArgs):
    data: bytes


@ocp.args.register_with_handler(_BytesHandler, for_restore=True)
@dataclass
class BytesRestore(ocp.args.CheckpointArgs):
    pass


@dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    meta: dict[str, Any]


def abstract_like(tree: Any, shardings: Any | None = None) -> Any:
    """`ShapeDtypeStruct` target of a pytree (with `shardings`, a matching pytree, if given)."""
    if shardings is None:
        return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _data_args(iterator: Any, *, save: bool) -> Any:
    """Orbax args for a data iterator: a loader exposing `checkpoint_save/restore()` (the
    project's `BatchLoader`) or a bare grain `DatasetIterator`."""
    method = "checkpoint_save" if save else "checkpoint_restore"
    if hasattr(iterator, method):
        return getattr(iterator, method)()
    import grain

    cls = grain.checkpoint.CheckpointSave if save else grain.checkpoint.CheckpointRestore
    return cls(iterator)


def stored_params(state: Any, dtype: str) -> Any:
    """`state` (a mapping of state items) with the float32 leaves of `PARAM_ITEMS` cast to
    `dtype` ("bfloat16": half their bytes on disk; "float32": unchanged)."""
    if dtype == "float32" or not isinstance(state, Mapping):
        return state

    def cast(x: Any) -> Any:
        return x.astype(jnp.bfloat16) if getattr(x, "dtype", None) == jnp.float32 else x

    return {k: jax.tree.map(cast, v) if k in PARAM_ITEMS else v for k, v in state.items()}


def warn_if_rounded(meta: Mapping[str, Any], what: str) -> None:
    """Say on stderr that `what` continues from bfloat16-rounded parameters (a
    `train.checkpoint_dtype: bfloat16` checkpoint): not the bit-exact continuation of the run."""
    if meta.get(PARAMS_DTYPE, "float32") != "float32":
        print(f"warning: {what} from a checkpoint whose parameters were stored in "
              f"{meta[PARAMS_DTYPE]} (train.checkpoint_dtype): they are cast back to float32, so "
              "the run is not bit-exact with an uninterrupted one", file=sys.stderr)


class Checkpointer:
    """Saves every `save_every` steps (and when forced), keeps the last `keep` checkpoints.

    `directory` may be any `etils.epath` path (local or `gs://`); a relative local path is
    made absolute (Orbax refuses relative ones). All processes of a multi-host job call
    `save`/`restore` (Orbax coordinates them); only committed steps count.
    """

    def __init__(
        self,
        directory: PathLike,
        *,
        save_every: int = 100,
        keep: int = 3,
        async_save: bool = True,
        params_dtype: str = "float32",
    ) -> None:
        if save_every <= 0 or keep <= 0:
            raise ValueError(f"save_every={save_every} and keep={keep} must be positive")
        if params_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"params_dtype must be float32 or bfloat16; got {params_dtype!r}")
        _register_array_handler()
        self.directory = as_path(directory)
        self.save_every = save_every
        self.params_dtype = params_dtype
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, create=True
            ),
        )

    def latest_step(self) -> int | None:
        """The newest *committed* step (partial async saves are ignored), or None."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def should_save(self, step: int) -> bool:
        return step > 0 and step % self.save_every == 0

    def save(
        self,
        step: int,
        state: Any,
        *,
        data_iterator: Any | None = None,
        meta: Mapping[str, Any] | None = None,
        blobs: Mapping[str, bytes] | None = None,
        force: bool = False,
    ) -> bool:
        """Start saving `state` (+ iterator position, JSON meta and `blobs`: items of bytes
        by name, read back with `read_blob`) as `step`.

        Returns immediately after the device→host copy when async; `wait()` blocks until the
        write is committed. Returns False when the step is not due (and not forced) or is
        already saved.
        """
        if not force and not self.should_save(step):
            return False
        if step in self.manager.all_steps():
            return False
        state = stored_params(state, self.params_dtype)
        items: dict[str, Any] = {STATE: ocp.args.StandardSave(state)}
        if data_iterator is not None:
            items[DATA] = _data_args(data_iterator, save=True)
        meta_dict = {"step": int(step), **dict(meta or {})}
        if self.params_dtype != "float32":  # said only when rounded (warn_if_rounded reads it)
            meta_dict[PARAMS_DTYPE] = self.params_dtype
        json.dumps(meta_dict)  # fail here, naming nothing half-written, if meta is not JSON
        items[META] = ocp.args.JsonSave(meta_dict)
        for name, data in (blobs or {}).items():
            if name in (STATE, DATA, META):
                raise ValueError(f"blob {name!r}: the name of a checkpoint's own item")
            items[name] = BytesSave(bytes(data))
        return bool(self.manager.save(step, args=ocp.args.Composite(**items), force=True))

    def restore(
        self,
        target: Any | None,
        *,
        step: int | None = None,
        data_iterator: Any | None = None,
    ) -> Restored:
        """Restore `step` (default: latest committed) onto `target`'s shapes and shardings.

        `target` is an abstract pytree (`abstract_like`), or None to read the arrays as saved
        (host-local, e.g. for export). A `data_iterator` given here is moved to the saved
        position in place.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        elif step not in self.manager.all_steps():
            raise FileNotFoundError(
                f"checkpoint step {step} not in {self.directory} (have {self.all_steps()})"
            )
        items: dict[str, Any] = {
            STATE: ocp.args.StandardRestore(target),
            META: ocp.args.JsonRestore(),
        }
        if data_iterator is not None:
            items[DATA] = _data_args(data_iterator, save=False)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return Restored(step=int(step), state=restored[STATE], meta=dict(restored[META]))

    def _step(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        return step

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """Only the JSON meta (config, step) of a checkpoint, without touching the arrays."""
        restored = self.manager.restore(
            self._step(step), args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
        )
        return dict(restored[META])

    def read_blob(self, name: str, step: int | None = None) -> bytes | None:
        """The bytes `save(blobs={name: ...})` stored in `step` (default: the latest committed),
        or None when that step was saved without them."""
        step = self._step(step)
        if not (self.directory / str(step) / name).exists():
            return None
        restored = self.manager.restore(step, args=ocp.args.Composite(**{name: BytesRestore()}))
        return restored[name]

    def wait(self) -> None:
        """Block until pending async saves are committed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- a model from a training checkpoint (export, evaluate) --------------------------------

CHECKPOINT_DIR = "checkpoints"


def locate(path: PathLike) -> tuple[epath.Path, int | None]:
    """(checkpoint manager directory, step or None) for a run directory, its `checkpoints/`
    directory, or one step directory `checkpoints/<step>`."""
    p = as_path(path)
    if (p / CHECKPOINT_DIR).is_dir():
        return p / CHECKPOINT_DIR, None
    if p.name.isdigit() and (p / STATE).is_dir():
        return p.parent, int(p.name)
    if p.is_dir() and any(c.name.isdigit() for c in p.iterdir()):
        return p, None
    raise FileNotFoundError(
        f"{p} is not a checkpoint: expected a run directory (with {CHECKPOINT_DIR}/), a "
        f"checkpoints directory, or a step directory ({CHECKPOINT_DIR}/<step>)"
    )


@dataclass(frozen=True)
class RestoredModel:
    model: Any  # NNX module with the checkpoint's parameters (in the model's own dtypes)
    config: Any  # the run's ExperimentConfig, as saved with the checkpoint
    step: int
    meta: dict[str, Any]


def restore_model(path: PathLike, *, step: int | None = None, mesh: Any | None = None
                  ) -> RestoredModel:
    """The policy saved in a checkpoint, restored from the config stored next to it.

    The train state is restored onto `mesh` (default: every local device on the "fsdp" axis,
    which spreads the weights) and, in a multi-host job, gathered so every process holds the
    full parameters (what an HF export needs).
    """
    directory, found = locate(path)
    step = step if step is not None else found
    ckpt = Checkpointer(directory, async_save=False)
    try:
        meta = ckpt.read_meta(step)
        if "config" not in meta:
            raise FileNotFoundError(f"{directory}: checkpoint meta has no resolved config")
        config = ExperimentConfig.model_validate(meta["config"])
        if mesh is None:
            mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))
        template = abstract_train_state(config, mesh)
        restored = ckpt.restore(abstract_like(state_items(template)), step=meta["step"])
    finally:
        ckpt.close()
    state = with_items(template, restored.state)
    if jax.process_count() > 1:
        gather = lambda tree: multihost_utils.process_allgather(tree, tiled=True)
        # model_state: a LoRA run's frozen base weights, sharded like the params.
        state = state.replace(params=gather(state.params), model_state=gather(state.model_state))
    return RestoredModel(model=state.model(), config=config, step=restored.step,
                         meta=restored.meta)
