"""Which run an exchange belongs to (`online.exchange`, docs/online.md § Pipeline).

The trainer writes `manifest.json` once: the model, the tokenizer and every config key that
changes what the run computes (sampling, data, loss, optimizer, trainer, seed), with their
hash, the *run id*. Every weight part and record shard carries that id. A side whose id
differs is refused, naming both runs and the keys that differ: a run with another learning
rate (or loss option, or seed) never takes another run's weights or samples because the
version numbers happen to match.

Left out, because they change no number a round computes: where files go (`core.paths.
RUN_PATH_KEYS`, two hosts may mount them differently), logging and checkpoint cadence, the
evaluation, the device mesh and split, and how long a side waits.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from jaxrl_llm.core.paths import RUN_PATH_KEYS
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.exchange import ExchangeError

# {section: keys} of the config that change no number a round computes ("" = top level).
NOT_COMPUTATION = {
    "": ("name", "run_dir", "model", "mesh", "plan", "eval", "metrics"),
    "train": ("log_every", "checkpoint_every", "keep_checkpoints", "eval_every",
              "record_trace", "check_memory", "grad_norm_by_sign", "max_nonfinite_steps"),
    "generate": ("records_per_shard", "chunk_prompts"),
    "data": ("read_threads", "prefetch"),
    "online": ("exchange", "worker_timeout_s", "sampler_devices", "checkpoint_every"),
}
_SAMPLING = ("seed", "generate", "data", "online")  # what a worker's rounds depend on


def differences(ours: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two JSON trees."""
    out = []
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What makes two tokenizers encode alike: name, vocabulary (hashed), special ids."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
    return {"name": getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
            "vocab": len(vocab), "vocab_sha256": digest,
            "eos_token_id": getattr(tokenizer, "eos_token_id", None),
            "pad_token_id": getattr(tokenizer, "pad_token_id", None)}


def computation_keys(config: OnlineConfig) -> dict[str, Any]:
    """The config without the keys of `NOT_COMPUTATION` and `RUN_PATH_KEYS` (module doc)."""
    tree = config.model_dump(mode="json")
    drop = [*RUN_PATH_KEYS] + [
        f"{section}.{key}" if section else key
        for section, keys in NOT_COMPUTATION.items() for key in keys]
    for key in drop:
        *sections, name = key.split(".")
        node = tree
        for section in sections:
            node = node.get(section, {})
        node.pop(name, None)
    return tree


def run_id(manifest: dict[str, Any]) -> str:
    """The hash naming a manifest's computation (its model, tokenizer and run keys)."""
    body = {k: manifest[k] for k in ("model", "tokenizer", "run")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def manifest_of(config: OnlineConfig, tokenizer: Any) -> dict[str, Any]:
    """What every side must agree on (module docstring), its run id, and what names the run
    to a person (`about`: not compared)."""
    manifest = {"model": config.model.model_dump(mode="json"), "tokenizer": tokenizer_identity(tokenizer),
                "run": computation_keys(config)}
    return {**manifest, "run_id": run_id(manifest),
            "about": {"name": config.name, "run_dir": str(config.run_dir)}}


def describe(manifest: dict[str, Any]) -> str:
    about = manifest.get("about", {})
    return (f"run {about.get('name', '?')!r} (id {manifest.get('run_id', '?')}, run_dir "
            f"{about.get('run_dir', '?')})")


def check_manifest(where: Any, ours: dict[str, Any], theirs: dict[str, Any],
                   side: str) -> None:
    """Refuse a side whose computation differs from the exchange's run (`where`: its
    manifest's path), naming both runs and the first keys that differ with both values."""
    keys = differences({k: ours[k] for k in ("model", "tokenizer", "run")},
                       {k: theirs.get(k, {}) for k in ("model", "tokenizer", "run")})
    if not keys:
        return

    def value(tree: dict[str, Any], key: str) -> Any:
        for part in key.split("."):
            tree = tree.get(part) if isinstance(tree, dict) else None
        return tree

    shown = "; ".join(f"{k}: {side} {value(ours, k)!r}, the exchange {value(theirs, k)!r}"
                      for k in keys[:6])
    heads = {k.split(".")[0] if not k.startswith("run.") else k.split(".")[1] for k in keys}
    what = ("model or tokenizer" if heads & {"model", "tokenizer"} else
            "sampling settings" if heads <= set(_SAMPLING) else "training settings")
    raise ExchangeError(
        f"this {side}'s {what} differ from what the trainer publishes in {where} "
        f"({shown}): this {side} is {describe(ours)}, the exchange holds {describe(theirs)}. "
        "Run every side with the same config, or give a new run an empty online.exchange")


def check_file_run(path: Any, what: str, found: str | None, ours: dict[str, Any]) -> None:
    """Refuse a weight part or record shard that another run wrote (its run id differs)."""
    if found != ours["run_id"]:
        raise ExchangeError(
            f"{path}: this {what} was written by the run with id {found}, not this "
            f"{describe(ours)}: another run shared this online.exchange. Give each run its "
            "own (empty) online.exchange, or delete the other run's files")
