"""One episode's bookkeeping, and the host executor every sampling backend uses.

A backend (the JAX continuous sampler, vLLM, `Policy.rollout`) calls `begin(problem)` for the
prompt ids, then `submit(episode, model_ids, logprobs, finished_by_stop)` each time the model's
turn ends; the future it gets back gives the observation's token ids to feed next, or None
when the episode is over; `finish(episode)` makes its record. Model tokens are kept exactly as
sampled (action mask 1, their sampler log-probs); environment and template tokens are context
(action mask 0, log-prob 0.0).

Environment calls run on host threads, at most `workers` at a time, each with a timeout. What
goes wrong ends as a truncated episode, marked in its record, never a crash:

| what | `Episode.truncated` |
| --- | --- |
| the model's turn ran out of tokens | "max_tokens" |
| an observation that leaves no room for a model token | "max_tokens" |
| an observation longer than `max_observation_tokens` | "max_observation_tokens" |
| the turn limit reached and the environment not done | "max_turns" |
| `respond` did not return within `timeout_s` | "env_timeout" |
| `respond` raised, or broke the protocol (a non-string content, a bad role) | "env_error" |

A thread cannot be killed in Python: a timed-out call is abandoned — its result is ignored and
its slot freed for the next call — but it keeps running until it returns (counted in
`EpisodeRunner.abandoned`), and whatever it does to its episode's state after that is the
environment's business. The reward is only ever `env.score`'s (docs/environments.md).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data.records import Record
from jaxrl_llm.envs.base import Environment, check_response
from jaxrl_llm.envs.render import TurnRenderer
from jaxrl_llm.tasks.base import Problem, RewardResult


@dataclasses.dataclass
class Episode:
    problem: Problem
    state: Any
    prompt_ids: list[int]
    completion_ids: list[int] = dataclasses.field(default_factory=list)  # model + env tokens
    action_mask: list[int] = dataclasses.field(default_factory=list)  # 1 = model token
    behavior_logprobs: list[float] = dataclasses.field(default_factory=list)  # 0.0 off-model
    turns: list[dict] = dataclasses.field(default_factory=list)  # spans, in order
    done: bool = False
    truncated: str | None = None
    model_turns: list[str] = dataclasses.field(default_factory=list)  # each turn's text
    pending: bool = False  # an environment call is in flight


def _jsonable(value: Any) -> Any:
    """`value` as JSON data (str/int/float/bool/None, lists, str-keyed dicts); repr otherwise."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


class EpisodeRunner:
    """Runs `env` against token turns; see the module docstring for the contract."""

    def __init__(self, env: Environment, renderer: TurnRenderer, *, max_turns: int,
                 max_episode_tokens: int, timeout_s: float, workers: int,
                 max_observation_tokens: int | None = None) -> None:
        for key, value in (("max_turns", max_turns), ("max_episode_tokens", max_episode_tokens),
                           ("timeout_s", timeout_s), ("workers", workers)):
            if not value > 0:
                raise ValueError(f"EpisodeRunner: {key}={value!r} must be > 0")
        self.env, self.renderer = env, renderer
        self.max_turns, self.max_episode_tokens = int(max_turns), int(max_episode_tokens)
        self.timeout_s, self.workers = float(timeout_s), int(workers)
        self.max_observation_tokens = max_observation_tokens
        self._slots = threading.BoundedSemaphore(self.workers)
        self._lock = threading.Lock()
        self.abandoned = 0  # timed-out calls still running on their threads

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end a model turn (the sampler stops a turn on them)."""
        return self.renderer.stop_ids

    @property
    def where(self) -> str:
        return f"environment {self.env.name or type(self.env).__name__!r}"

    def begin(self, problem: Problem) -> Episode:
        """A new episode: its state and prompt ids (system and user turns, tools listed)."""
        state = self.env.start(problem)
        prompt = self.renderer.prompt_ids(self.env.system_prompt(problem),
                                          self.env.user_prompt(problem))
        return Episode(problem=problem, state=state, prompt_ids=prompt)

    # -- a model turn ------------------------------------------------------------------------

    def submit(self, episode: Episode, model_ids: Sequence[int], logprobs: Sequence[float],
               finished_by_stop: bool) -> concurrent.futures.Future:
        """Append the model's turn and answer it (module docstring)."""
        model_ids, logprobs = [int(t) for t in model_ids], [float(x) for x in logprobs]
        if len(model_ids) != len(logprobs):
            raise ValueError(f"model turn of {len(model_ids)} tokens with {len(logprobs)} log-probs")
        if episode.done or episode.pending:
            raise RuntimeError(f"episode of {episode.problem.id} is "
                               f"{'over' if episode.done else 'waiting for its environment'}")
        start = len(episode.completion_ids)
        episode.completion_ids += model_ids
        episode.action_mask += [1] * len(model_ids)
        episode.behavior_logprobs += logprobs
        stop = ("end_of_turn" if model_ids and model_ids[-1] == self.renderer.end_of_turn_id
                else "stop" if finished_by_stop else "length")
        episode.model_turns.append(self.renderer.tokenizer.decode(model_ids,
                                                                  skip_special_tokens=True))
        # the turn's own text, so `data show` prints each turn where it is
        episode.turns.append({"kind": "model", "start": start, "end": len(episode.completion_ids),
                              "stop": stop, "text": episode.model_turns[-1]})
        future: concurrent.futures.Future = concurrent.futures.Future()
        if stop == "length":
            return self._end(future, episode, "max_tokens")
        if stop == "stop":  # EOS that is not the template's end of turn: the model ended it
            return self._end(future, episode, None)
        episode.pending = True
        threading.Thread(target=self._supervise, args=(future, episode),
                         name="env-call", daemon=True).start()
        return future

    def _end(self, future: concurrent.futures.Future, episode: Episode, truncated: str | None,
             ) -> concurrent.futures.Future:
        episode.done, episode.truncated, episode.pending = True, truncated, False
        future.set_result(None)
        return future

    def _supervise(self, future: concurrent.futures.Future, episode: Episode) -> None:
        """Run one `respond` on its own thread, waiting at most `timeout_s` for it."""
        outcome: dict[str, Any] = {}

        def call() -> None:
            try:
                outcome["response"] = self.env.respond(episode.state, episode.model_turns[-1])
            except BaseException as err:  # the environment's failure, recorded on the episode
                outcome["error"] = f"{type(err).__name__}: {err}"

        with self._slots:
            worker = threading.Thread(target=call, name="env-respond", daemon=True)
            worker.start()
            worker.join(self.timeout_s)
        try:
            if worker.is_alive():
                with self._lock:
                    self.abandoned += 1
                self._env_span(episode, [], {"error": f"respond() did not return within "
                                             f"{self.timeout_s:g} s (env.timeout_s)"})
                self._end(future, episode, "env_timeout")
            elif "error" in outcome:
                self._env_span(episode, [], {"error": outcome["error"]})
                self._end(future, episode, "env_error")
            else:
                self._answer(future, episode, outcome["response"])
        except BaseException as err:  # never leave the sampler waiting on a future
            if not future.done():
                self._env_span(episode, [], {"error": f"{type(err).__name__}: {err}"})
                self._end(future, episode, "env_error")

    def _answer(self, future: concurrent.futures.Future, episode: Episode, response: Any) -> None:
        try:
            response = check_response(response, self.where)
        except TypeError as err:
            self._env_span(episode, [], {"error": str(err)})
            self._end(future, episode, "env_error")
            return
        info = dict(response.info)
        if response.done:  # messages of a finished episode are kept, never fed
            self._env_span(episode, [], info, response.reward, dropped=response.messages)
            self._end(future, episode, None)
            return
        if len(episode.model_turns) >= self.max_turns:
            self._env_span(episode, [], info, response.reward, dropped=response.messages)
            self._end(future, episode, "max_turns")
            return
        try:
            ids = self.renderer.observation_ids(response.messages)
        except Exception as err:  # a template that cannot render these messages
            self._env_span(episode, [], {**info, "error": f"{type(err).__name__}: {err}"})
            self._end(future, episode, "env_error")
            return
        left = self.max_episode_tokens - len(episode.completion_ids)
        limit = self.max_observation_tokens
        too_long = ("max_observation_tokens" if limit is not None and len(ids) > limit
                    else "max_tokens" if len(ids) + 1 > left else None)  # +1: room to answer
        if too_long:
            self._env_span(episode, [], {**info, "observation_tokens": len(ids),
                                         "tokens_left": left}, response.reward,
                           dropped=response.messages)
            self._end(future, episode, too_long)
            return
        self._env_span(episode, ids, info, response.reward, messages=response.messages)
        episode.pending = False
        future.set_result(ids)

    def _env_span(self, episode: Episode, ids: list[int], info: dict[str, Any],
                  reward: float | None = None, *, messages: Sequence[dict] = (),
                  dropped: Sequence[dict] = ()) -> None:
        """Append the observation's tokens and its span (messages, info, reward)."""
        start = len(episode.completion_ids)
        episode.completion_ids += ids
        episode.action_mask += [0] * len(ids)
        episode.behavior_logprobs += [0.0] * len(ids)
        span: dict[str, Any] = {"kind": "env", "start": start, "end": len(episode.completion_ids),
                                "messages": _jsonable(list(messages)), "info": _jsonable(info),
                                "reward": None if reward is None else float(reward)}
        if dropped:  # what the environment said that no model turn will read
            span["dropped_messages"] = _jsonable(list(dropped))
        episode.turns.append(span)

    # -- the record ----------------------------------------------------------------------------

    def score(self, episode: Episode) -> RewardResult:
        """`env.score` for a finished episode, checked (a RewardResult with a finite reward)."""
        result = self.env.score(episode.state, episode.problem, list(episode.model_turns))
        if not isinstance(result, RewardResult):
            raise TypeError(f"{self.where}: score() returned {type(result).__name__}, not a "
                            "RewardResult")
        if not math.isfinite(result.reward):
            raise ValueError(f"{self.where}: score() gave a non-finite reward {result.reward} "
                             f"for {episode.problem.id}")
        return result

    def finish(self, episode: Episode, *, group_id: int = 0) -> Record:
        """The episode's record: every token, the action mask, and metadata["episode"]."""
        if episode.pending or not episode.done:
            raise RuntimeError(f"episode of {episode.problem.id} is not over")
        result = self.score(episode)
        env_spans = [t for t in episode.turns if t["kind"] == "env"]
        calls = [c for t in env_spans for c in (t["info"].get("tool_calls") or [])]
        meta = {
            "turns": episode.turns, "num_turns": len(episode.model_turns),
            "tool_calls": len(calls),
            "tool_errors": sum(int(t["info"].get("tool_errors", 0)) for t in env_spans),
            "truncated": episode.truncated,
            "turn_rewards": [t["reward"] for t in env_spans],
            "environment": self.env.name or type(self.env).__name__,
        }
        tokenizer = self.renderer.tokenizer
        problem = episode.problem
        return Record(
            prompt_ids=np.asarray(episode.prompt_ids, np.int32),
            completion_ids=np.asarray(episode.completion_ids, np.int32),
            action_mask=np.asarray(episode.action_mask, np.uint8),
            behavior_logprobs=np.asarray(episode.behavior_logprobs, np.float32),
            reward=result.reward, correct=result.correct, invalid=result.invalid,
            group_id=group_id, task=getattr(getattr(self.env, "task", None), "name", "") or "",
            answer=result.answer,
            prompt_text=tokenizer.decode(episode.prompt_ids, skip_special_tokens=False),
            completion_text=tokenizer.decode(episode.completion_ids, skip_special_tokens=False),
            metadata={"problem_id": problem.id, "question": problem.question,
                      "gold": problem.answer, **_jsonable(dict(result.info)), "episode": meta},
        )
