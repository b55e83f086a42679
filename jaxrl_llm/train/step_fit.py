"""Before step 1: compile the train step for the run's largest batch, check it fits
(`parallel/memory.py`) and, when it does not, pick micro-batches or refuse with the fix.

The check compiles the step the loop then calls (jit's cache holds the executable, so the
first step does not compile again). When it does not fit and `train.micro_batch_size` is
unset, the batch is split into 2, 4, … micro-batches (gradients accumulated in the step: the
same loss and update, docs/architecture.md § Contracts) until one fits; otherwise — or when
no split fits — `InsufficientMemory` names the figure and the settings that would help.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax

from jaxrl_llm.config import ExperimentConfig
from jaxrl_llm.data.batch import TOKEN_FIELDS, array_fields
from jaxrl_llm.parallel.memory import (
    InsufficientMemory,
    ProgramMemory,
    available_memory,
    describe,
    fits,
    gib,
    held_bytes,
    program_memory,
)
from jaxrl_llm.parallel.mesh import batch_shards
from jaxrl_llm.train.loss_fn import needs_full_batch

StepBuilder = Callable[[ExperimentConfig], Any]  # config -> jitted train step


def largest_batch(batch: Any, max_seq_len: int) -> Any:
    """`batch` itself when its rows are `max_seq_len` long, else its abstract twin at that
    length (length buckets: the longest bucket is the peak)."""
    if batch.inputs.shape[1] == max_seq_len:
        return batch

    def spec(name: str, x: Any) -> Any:
        # token arrays, and the routing [B, T, L, k]: T becomes max_seq_len
        long = name in TOKEN_FIELDS or name == "routing"
        shape = (x.shape[0], max_seq_len, *x.shape[2:]) if long else x.shape
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)

    return batch.replace(**{n: spec(n, getattr(batch, n)) for n in array_fields(batch)})


def _checkpoint_copy(config: ExperimentConfig, memory: ProgramMemory) -> int:
    """An async checkpoint before the last step copies the state to the host while the next
    steps run; on a host that copy competes with the step (state ≈ the arguments)."""
    return memory.argument if config.train.checkpoint_every < config.train.steps else 0


def _micro_candidates(config: ExperimentConfig, shards: int) -> list[int]:
    """Micro-batch sizes to try, largest first: halvings that stay multiples of the shards."""
    if config.train.micro_batch_size is not None or needs_full_batch(config):
        return []
    sizes, size = [], config.train.batch_size
    while size % 2 == 0 and (size // 2) % shards == 0:
        size //= 2
        sizes.append(size)
    return sizes


def _fixes(config: ExperimentConfig, tried_micro: bool) -> str:
    m, t = config.model, config.train
    fixes = []
    if m.remat == "none" or not m.scan_layers:
        fixes.append("model.remat=full model.scan_layers=true (recompute each layer's "
                     "activations in the backward pass)")
    if not tried_micro:
        fixes.append("a smaller train.micro_batch_size (gradients accumulated over "
                     "micro-batches: the same update)")
    fixes.append(f"a smaller train.max_seq_len (now {t.max_seq_len}) or train.batch_size "
                 f"(now {t.batch_size})")
    if config.mesh.fsdp == 1:
        fixes.append("more devices with mesh.fsdp>1 (parameters and optimizer state sharded)")
    fixes.append("or train.check_memory=false to start anyway")
    return "; ".join(fixes)


def fit_train_step(config: ExperimentConfig, mesh: Any, state: Any, batch: Any,
                   build: StepBuilder, *, say: Callable[[str], None] | None = None,
                   ) -> tuple[ExperimentConfig, Any, ProgramMemory | None]:
    """(config, jitted step, its memory) that fit, compiled for `batch`'s largest shape;
    `say` gets one line about the memory (and any micro-batch chosen)."""
    say = say or (lambda text: print(text, file=sys.stderr))
    step = build(config)
    if not config.train.check_memory or not hasattr(step, "lower"):
        return config, step, None  # off, or a wrapped step (tests) that cannot be compiled

    target = largest_batch(batch, config.train.max_seq_len)
    device = mesh.devices.flat[0]
    available = available_memory(device)
    memory = program_memory(step.lower(state, target).compile(), mesh)
    extra = _checkpoint_copy(config, memory)
    if fits(memory, available, extra):
        say(f"memory: the train step needs {gib(memory.peak)} at its peak "
            f"({gib(memory.argument)} of it resident; this process holds "
            f"{gib(held_bytes(device))} now); {gib(available.bytes)} is {available.where}")
        return config, step, memory
    first = describe("the train step", memory, available, extra)
    candidates = _micro_candidates(config, batch_shards(mesh))
    for micro in candidates:
        trial = config.model_copy(update={"train": config.train.model_copy(
            update={"micro_batch_size": micro})})
        step = build(trial)
        memory = program_memory(step.lower(state, target).compile(), mesh)
        if fits(memory, available, extra):
            say(f"memory: {first}; using train.micro_batch_size={micro} "
                f"({config.train.batch_size // micro} micro-batches, the same update): "
                f"{gib(memory.peak)} at its peak")
            return trial, step, memory
    tried = (f"; with train.micro_batch_size={candidates[-1]} it still needs "
             f"{gib(memory.peak)}") if candidates else ""
    raise InsufficientMemory(f"{first}{tried}. It would be killed for lack of memory, so it "
                             f"was not started. Try {_fixes(config, bool(candidates))}")
