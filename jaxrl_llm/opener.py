"""The one place that decides what a model path is, and opens it.

`open_model(source, config)` accepts what a user may hand any command:

| `source` | what it is | loaded by |
| --- | --- | --- |
| None | the config's own `model:` section (random, hf, gguf, smollm2) | `weights.loading.load_model` |
| `"smollm2"` | the packaged SmolLM2-135M-Instruct GGUF | `weights.loading.load_model` |
| `*.gguf` | one GGUF file | `weights.loading.load_model` (source gguf) |
| a directory with `config.json` (local or `gs://`) | a Hugging Face directory (an export) | `weights.loading.load_model` (source hf) |
| `org/name` | a Hugging Face Hub id (resolved from the HF cache) | `weights.hub` + source hf |
| a run directory, its `checkpoints/`, or one step directory | an Orbax training checkpoint | `train.checkpoint.restore_model` |

The config's numerics (dtypes, remat, layer scan, LoRA) apply to every pretrained source; a
checkpoint brings the configuration it was trained with.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from jaxrl_llm.paths import as_path, copy_tree, is_remote

Kind = Literal["config", "gguf", "hf", "checkpoint"]


@dataclass(frozen=True)
class OpenedModel:
    model: Any  # NNX decoder
    tokenizer: Any
    config: Any  # the ExperimentConfig the model is used with (a checkpoint's own)
    kind: Kind
    info: dict[str, Any] = field(default_factory=dict)  # "model" (a name) and, checkpoints, "step"


def classify(source: str | None, *, key: str = "model") -> tuple[Kind, str | None]:
    """(kind, path) of `source` (module docstring's table); a clear error naming `key` when
    it is none of them."""
    from jaxrl_llm.weights.hub import is_hub_id

    if source is None:
        return "config", None
    if source == "smollm2":
        return "gguf", None
    if source.endswith(".gguf"):
        if not Path(source).is_file():
            raise FileNotFoundError(f"{key}={source}: GGUF file not found")
        return "gguf", source
    path = as_path(source)
    if (path / "config.json").is_file():
        return "hf", source
    if is_hub_id(source):
        return "hf", source
    if path.exists():
        return "checkpoint", source
    raise FileNotFoundError(
        f"{key}={source}: no such file or directory: not a checkpoint, nor a model "
        "(expected smollm2, a .gguf file, an HF directory, a Hub id org/name, or a run / "
        "checkpoint directory)")


def model_section(config: Any, kind: Kind, path: str | None) -> Any:
    """`config.model` pointed at a pretrained source (its numerics kept)."""
    if kind == "gguf":
        update = {"source": "smollm2", "path": None} if path is None else {"source": "gguf",
                                                                            "path": path}
    else:
        update = {"source": "hf", "path": path}
    return config.model.model_copy(update=update)


def open_model(source: str | None, config: Any, *, mesh: Any = None, tokenizer: str | None = None,
               key: str = "model") -> OpenedModel:
    """The model and tokenizer `source` names (module docstring), on `mesh` when given (a
    checkpoint is restored onto it, or onto every local device's "fsdp" axis).
    `tokenizer`: a tokenizer directory overriding the source's own."""
    from jaxrl_llm.generate.loading import model_and_tokenizer, tokenizer_from_config
    from jaxrl_llm.weights.loading import check_tokenizer_fits

    kind, path = classify(source, key=key)
    if kind == "checkpoint":
        from jaxrl_llm.train.checkpoint import restore_model

        restored = restore_model(path, mesh=mesh)
        run_config = restored.config
        if tokenizer is not None:
            run_config = run_config.model_copy(update={
                "data": run_config.data.model_copy(update={"tokenizer": tokenizer})})
        tok = tokenizer_from_config(run_config)
        check_tokenizer_fits(tok, restored.model.config.vocab_size,
                             tokenizer_from=str(tokenizer or run_config.data.tokenizer or "char"),
                             model_from=str(path))
        return OpenedModel(restored.model, tok, restored.config, kind,
                           {"model": str(path), "step": restored.step})
    name = path or (config.model.path if kind == "config" else "smollm2") or config.model.source
    if kind == "hf" and path is not None and is_remote(as_path(path)):
        path = str(copy_tree(as_path(path), tempfile.mkdtemp(prefix="jaxrl-model-")))
    if kind != "config":
        config = config.model_copy(update={"model": model_section(config, kind, path)})
    if tokenizer is not None:
        config = config.model_copy(update={"data": config.data.model_copy(
            update={"tokenizer": tokenizer})})
    model, tok = model_and_tokenizer(config, mesh=mesh)
    return OpenedModel(model, tok, config, kind, {"model": str(name)})
