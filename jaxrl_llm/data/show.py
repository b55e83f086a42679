"""A record as text for `jaxrl-llm data show`: a single-turn record as its prompt and
completion; a multi-turn episode as its turns, model and environment in order.

An episode's turns come from `metadata["episode"]["turns"]`, the spans `envs.episodes`
writes over the completion's tokens (`end` exclusive; an environment span may be empty, e.g.
an error that ended the episode):

    {"kind": "model", "start": i, "end": j, "stop": ..., "text": ... (optional)}
    {"kind": "env", "start": i, "end": j, "messages": [{"role", "content", "name"?}],
     "info": {"tool_calls": [{"name", "arguments", "result" | "error"}], "error": ...},
     "reward": float | None, "dropped_messages": [...] (what no model turn read)}

and from `Record.action_mask`, which alone gives the spans when the metadata has none (or
spans that disagree with it). Nothing here raises on odd metadata: it is free-form JSON, so
whatever a span holds beyond these keys is shown as JSON.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from jaxrl_llm.data.records import Record

# Keys of a turn span (and of its "info") shown in their own way; any other key is printed
# as `key: JSON`.
_SPAN_KEYS = ("kind", "start", "end", "stop", "text", "messages", "dropped_messages", "info",
              "reward")
_INFO_KEYS = ("tool_calls", "error")


def is_episode(record: Record) -> bool:
    """A multi-turn episode: an action mask, or episode metadata."""
    return record.action_mask is not None or isinstance(record.metadata.get("episode"), dict)


def mask_spans(model: np.ndarray) -> list[dict[str, Any]]:
    """The runs of equal values of the bool model-token mask as turn spans."""
    edges = np.flatnonzero(np.diff(model.astype(np.int8))) + 1
    starts = [0, *edges.tolist()]
    ends = [*edges.tolist(), int(model.size)]
    return [{"kind": "model" if model[s] else "env", "start": s, "end": e}
            for s, e in zip(starts, ends) if e > s]


def episode_spans(record: Record, model: np.ndarray) -> tuple[list[dict[str, Any]], str | None]:
    """(spans, note): the metadata's turn spans when they tile the completion and agree with
    the mask, else the mask's runs and a note saying why the metadata's were not used."""
    episode = record.metadata.get("episode")
    turns = episode.get("turns") if isinstance(episode, dict) else None
    if not turns:
        return mask_spans(model), None
    n = int(model.size)
    at = 0
    for i, span in enumerate(turns):
        ok = (isinstance(span, dict) and span.get("kind") in ("model", "env")
              and isinstance(span.get("start"), int) and isinstance(span.get("end"), int)
              and span["start"] == at and at <= span["end"] <= n)
        if not ok:
            return mask_spans(model), (f"metadata episode.turns[{i}] is not a span continuing at "
                                       f"token {at} (turns shown from action_mask)")
        if not np.all(model[span["start"]:span["end"]] == (span["kind"] == "model")):
            return mask_spans(model), (f"metadata episode.turns[{i}] ({span['kind']}, tokens "
                                       f"{span['start']}-{span['end']}) disagrees with "
                                       "action_mask (turns shown from action_mask)")
        at = span["end"]
    if at != n:
        return mask_spans(model), (f"metadata episode.turns end at token {at} of {n} (turns "
                                   "shown from action_mask)")
    return list(turns), None


def _count(value: Any) -> int | None:
    """A count given as a number or as a list of items; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return int(value)
    return len(value) if isinstance(value, list) else None


def episode_counts(record: Record) -> dict[str, Any]:
    """Model turns, tool calls, model and environment tokens and the truncation of an episode:
    the metadata's counts when given, else counted from its spans."""
    model = record.model_tokens()
    episode = record.metadata.get("episode")
    episode = episode if isinstance(episode, dict) else {}
    spans, _ = episode_spans(record, model)
    turns = _count(episode.get("num_turns"))
    if turns is None:
        turns = sum(s["kind"] == "model" for s in spans)
    calls = _count(episode.get("tool_calls"))
    if calls is None:
        calls = sum(len(_calls(s)) for s in spans)
    return {"turns": turns, "tool_calls": calls, "model_tokens": int(model.sum()),
            "environment_tokens": int((~model).sum()), "truncated": episode.get("truncated")}


def _calls(span: dict[str, Any]) -> list[Any]:
    """The tool calls an environment span answered (its info's)."""
    info = span.get("info")
    calls = info.get("tool_calls") if isinstance(info, dict) else None
    return calls if isinstance(calls, list) else []


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _tool_call(call: Any) -> str:
    """`name(arguments) -> result` or `... -> error: why`; a call that did not parse is its error."""
    if not isinstance(call, dict):
        return _text(call)
    if "name" not in call:
        return f"error: {_text(call.get('error', call))}"
    args = call.get("arguments")
    text = f"{call['name']}({json.dumps(args, ensure_ascii=False) if args is not None else ''})"
    if "error" in call:
        return f"{text} -> error: {_text(call['error'])}"
    return f"{text} -> {_text(call['result'])}" if "result" in call else text


def _message(message: Any) -> str:
    if not isinstance(message, dict):
        return _text(message)
    who = " ".join(_text(message[k]) for k in ("role", "name") if message.get(k))
    return f"[{who or '?'}] {_text(message.get('content', ''))}"


def _span_lines(span: dict[str, Any], number: int) -> list[str]:
    kind = "model turn" if span["kind"] == "model" else "environment turn"
    size = span["end"] - span["start"]
    where = f"tokens {span['start']}-{span['end'] - 1}: {size}" if size else "no tokens"
    head = f"--- {kind} {number} ({where}"
    head += f", stop: {_text(span['stop'])})" if span.get("stop") is not None else ")"
    if span.get("reward") is not None:
        head += f"  turn reward {_text(span['reward'])}"
    lines = [head]
    lines += [f"tool call: {_tool_call(call)}" for call in _calls(span)]
    info = span.get("info") if isinstance(span.get("info"), dict) else {}
    if info.get("error"):
        lines.append(f"error: {_text(info['error'])}")
    lines += [f"{key}: {json.dumps(value, ensure_ascii=False)}" for key, value in info.items()
              if key not in _INFO_KEYS]
    lines += [_message(m) for m in span.get("messages") or []]
    lines += [f"(not shown to the model) {_message(m)}" for m in span.get("dropped_messages") or []]
    if span.get("text") is not None:
        lines.append(_text(span["text"]))
    lines += [f"{key}: {json.dumps(value, ensure_ascii=False)}" for key, value in span.items()
              if key not in _SPAN_KEYS]
    return lines


def render_record(record: Record, where: str) -> str:
    """`data show`'s text of one record."""
    r = record
    flags = "correct" if r.correct else ("invalid" if r.invalid else "incorrect")
    lines = [f"=== {where}  group {r.group_id}  reward {r.reward:+g}  {flags}  answer {r.answer!r}",
             f"--- prompt ({r.prompt_ids.size} tokens)", r.prompt_text]
    if not is_episode(r):
        lines += [f"--- completion ({r.completion_ids.size} tokens)", r.completion_text]
        return "\n".join(lines)
    model = r.model_tokens(where=where)
    spans, note = episode_spans(r, model)
    c = episode_counts(r)
    summary = (f"--- episode ({r.completion_ids.size} tokens: {c['model_tokens']} model, "
               f"{c['environment_tokens']} environment): {c['turns']} model turns, "
               f"{c['tool_calls']} tool calls")
    if c["truncated"]:
        summary += f", truncated: {_text(c['truncated'])}"
    lines.append(summary)
    if note:
        lines.append(f"({note})")
    numbers = {"model": 0, "env": 0}
    for span in spans:
        numbers[span["kind"]] += 1
        lines += _span_lines(span, numbers[span["kind"]])
    if any(s["kind"] == "model" and s.get("text") is None for s in spans):
        lines += ["--- completion text (all turns)", r.completion_text]
    return "\n".join(lines)
