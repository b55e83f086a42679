"""Build the task, tokenizer and model an experiment config names (generate/score commands).

The functions read only the `data`, `model` and `seed` fields of the config they are given
(a protocol, so that this package does not import the whole config schema).
"""

from __future__ import annotations

import string
from typing import Any, Protocol

from jaxrl_llm.errors import ConfigError
from jaxrl_llm.tasks import Task, get_task


class ExperimentConfig(Protocol):
    """The fields read here: `data` (task, task_options, task_path, reward_scheme, tokenizer),
    `model` (the `model:` section) and `seed`."""

    @property
    def data(self) -> Any: ...

    @property
    def model(self) -> Any: ...

    @property
    def seed(self) -> int: ...

# Character alphabet of the default tokenizer for random-init models: every task prompt fits.
CHAR_ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n\t"


def task_from_config(config: ExperimentConfig) -> Task:
    d = config.data
    kwargs: dict[str, Any] = {"reward_scheme": d.reward_scheme, **d.task_options}
    if d.task_path is not None:
        kwargs["path"] = d.task_path
    try:
        task = get_task(d.task, **kwargs)
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"data.task={d.task!r} / data.task_options: {err}") from err
    if getattr(d, "system_prompt", None):
        from jaxrl_llm.tasks.base import with_system_prompt

        task = with_system_prompt(task, d.system_prompt)
    return task


def char_tokenizer() -> Any:
    from jaxrl_llm.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer(CHAR_ALPHABET)


def tokenizer_from_config(config: ExperimentConfig) -> Any:
    """`data.tokenizer` when set; else the source's own: the char tokenizer (random), the
    GGUF file's (gguf, smollm2; read without its weights) or `model.path`'s files (hf)."""
    name = config.data.tokenizer
    m = config.model
    if name == "char" or (name is None and m.source == "random"):
        tok = char_tokenizer()
        if len(tok) > m.vocab_size:
            raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the char tokenizer ({len(tok)})")
        return tok
    if name is None and m.source in ("gguf", "smollm2"):
        from jaxrl_llm.weights.loading import source_tokenizer

        return source_tokenizer(m)
    from transformers import AutoTokenizer

    path = name or m.path
    if path is None:
        raise ConfigError("data.tokenizer (or model.path) must name a tokenizer directory")
    from jaxrl_llm.weights.hub import resolve_model_dir  # a hub id -> its cached snapshot

    path = resolve_model_dir(str(path), revision=None if name else m.revision,
                             key="data.tokenizer" if name else "model.path")
    return AutoTokenizer.from_pretrained(path)


def model_and_tokenizer(config: ExperimentConfig, *, mesh: Any = None) -> tuple[Any, Any]:
    """(NNX decoder, tokenizer) for `config.model`, loaded by `weights.loading.load_model`
    (with `mesh`: every parameter straight into its sharding)."""
    from jaxrl_llm.weights.loading import check_tokenizer_fits, load_model

    model, own = load_model(config.model, seed=config.seed, mesh=mesh)
    if own is not None and config.data.tokenizer is None:
        return model, own  # the GGUF's own tokenizer (checked against it by read_gguf)
    tokenizer = tokenizer_from_config(config)
    m = config.model
    check_tokenizer_fits(tokenizer, model.config.vocab_size,
                         tokenizer_from=str(config.data.tokenizer or m.path or "char"),
                         model_from=str(m.path or f"model.source={m.source}"))
    return model, tokenizer
