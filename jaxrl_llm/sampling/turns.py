"""Multi-turn episodes in the continuous sampler: the host side of a slot parked at a turn
boundary (`ContinuousSampler.generate(turns=...)`).

A slot whose sample stops on a turn's stop token (or runs out of tokens) hands its model turn
to a `TurnHook` (the environments' episode runner, `jaxrl_llm.envs.episodes`), which answers
later, from its own threads, with the observation's token ids — or None when the episode is
over. Until then the slot is *parked*: it keeps its cache and its place, and the other slots
go on decoding. When the answer comes, the observation's ids go into the slot's `feed` row at
the completion positions they take, and `slot_program.resume_slots` runs it again: the fed
tokens enter the cache one decode step each (no token is recomputed or re-tokenised), then
the model samples its next turn. Fed positions have log-prob 0 and action mask 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Protocol

import numpy as np


class TurnHook(Protocol):
    """What the sampler needs from an episode runner."""

    stop_ids: Sequence[int]  # token ids that end a model turn (added to the stop tokens)

    def submit(self, row: int, tokens: np.ndarray, logprobs: np.ndarray, stopped: bool
               ) -> Future:
        """Output row `row`'s model turn just ended (`tokens`, their sampler log-probs;
        `stopped`: on a stop token, else out of tokens). The future's result: the
        environment's token ids to feed next (list[int]), or None when the episode ended."""
        ...


class TurnError(RuntimeError):
    """An episode runner broke the sampler's contract (an answer that does not fit)."""


class ParkedSlots:
    """The slots waiting for their environment, and the feed rows of every slot (a host
    mirror of the compiled program's `feed`, kept in the same slot order)."""

    def __init__(self, slots: int, max_new: int):
        self.max_new = max_new
        self.feed = np.full((slots, max_new), -1, np.int32)
        self.turn_start = np.zeros(slots, np.int64)  # where each slot's model turn began
        self.waiting: dict[int, Future] = {}  # slot → its environment's answer
        self.turns_submitted = self.turns_resumed = 0

    def __len__(self) -> int:
        return len(self.waiting)

    def parked(self, slots: int) -> np.ndarray:
        mask = np.zeros(slots, bool)
        mask[list(self.waiting)] = True
        return mask

    def assigned(self, slot: int) -> None:
        """`slot` starts a new episode at completion position 0."""
        self.feed[slot] = -1
        self.turn_start[slot] = 0

    def keep(self, rows: np.ndarray) -> None:
        """Follow `select_slots(rows)`: slot rows[i] becomes slot i."""
        where = {int(old): new for new, old in enumerate(rows)}
        if any(s not in where for s in self.waiting):
            raise TurnError("a parked slot was dropped by the tail compaction")
        self.feed, self.turn_start = self.feed[rows], self.turn_start[rows]
        self.waiting = {where[s]: f for s, f in self.waiting.items()}

    def park(self, hook: TurnHook, slot: int, row: int, tokens: np.ndarray,
             logprobs: np.ndarray, t: int, stopped: bool) -> None:
        """Hand slot `slot`'s turn (completion positions turn_start..t) to the runner."""
        start = int(self.turn_start[slot])
        self.waiting[slot] = hook.submit(row, tokens[start:t], logprobs[start:t], stopped)
        self.turns_submitted += 1

    def answered(self, *, block: bool) -> list[tuple[int, list[int] | None]]:
        """The parked slots whose environment has answered, with the answer (waits for the
        first one when `block`)."""
        if block and self.waiting:
            wait(list(self.waiting.values()), return_when=FIRST_COMPLETED)
        ready = [(s, f) for s, f in self.waiting.items() if f.done()]
        for s, _ in ready:
            del self.waiting[s]
        return [(s, f.result()) for s, f in ready]

    def feed_observation(self, slot: int, t: int, ids: Sequence[int]) -> None:
        """Put the environment's `ids` at completion positions t.. of `slot`; the model's
        next turn starts after them. The runner keeps a token for it (`max_new`)."""
        ids = np.asarray(ids, np.int32)
        if len(ids) == 0 or t + len(ids) >= self.max_new or (ids < 0).any():
            raise TurnError(f"an observation of {len(ids)} tokens at position {t} does not fit "
                            f"max_new_tokens={self.max_new} with room for a model turn "
                            "(the episode runner must end the episode instead)")
        self.feed[slot, t:t + len(ids)] = ids
        self.turn_start[slot] = t + len(ids)
        self.turns_resumed += 1

    def action_mask(self, slot: int, t: int) -> np.ndarray:
        """Slot's positions 0..t-1: 1 where the model sampled, 0 where the environment fed."""
        return (self.feed[slot, :t] < 0).astype(np.uint8)
