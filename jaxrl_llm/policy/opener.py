"""The entry for a model: every command (generate, iterate, quickstart, score, evaluate,
export) and the API open their model and tokenizer here, and only here.

`open_model(source, config)` accepts what a user may hand any command:

| `source` | what it is | loaded by |
| --- | --- | --- |
| None | the config's own `model:` section (random, hf, gguf, smollm2) | `weights.loading.load_model` |
| `"smollm2"` | the packaged SmolLM2-135M-Instruct GGUF | `weights.loading.load_model` |
| `*.gguf` | one GGUF file | `weights.loading.load_model` (source gguf) |
| a directory with `config.json` (local or `gs://`) | a Hugging Face directory (an export) | `weights.loading.load_model` (source hf) |
| `org/name` | a Hugging Face Hub id (resolved from the HF cache) | `weights.hub` + source hf |
| a run directory, its `checkpoints/`, or one step directory | an Orbax training checkpoint | `train.checkpoint.restore_model` (`open_checkpoint`) |

The config's numerics (dtypes, remat, layer scan, LoRA) apply to every pretrained source; a
checkpoint brings the configuration it was trained with. The tokenizer is the config's
`data.tokenizer` (or `tokenizer=`), else the source's own (`weights.loading.load_tokenizer`),
and must fit the model's vocabulary. `open_tokenizer` is the tokenizer alone (stages that
need no weights: vLLM sampling, gold records, the training-time evaluation).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from jaxrl_llm.core.paths import as_path, copy_tree, is_remote
from jaxrl_llm.train.checkpoint import restore_model
from jaxrl_llm.weights.hub import is_hub_id
from jaxrl_llm.weights.loading import check_tokenizer_fits, load_model, load_tokenizer

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
               key: str = "model", with_tokenizer: bool = True) -> OpenedModel:
    """The model and tokenizer `source` names (module docstring), on `mesh` when given (a
    checkpoint is restored onto it, or onto every local device's "fsdp" axis).
    `tokenizer`: a tokenizer directory overriding the source's own. `with_tokenizer=False`:
    the model alone (`score`), `OpenedModel.tokenizer` None."""
    kind, path = classify(source, key=key)
    if kind == "checkpoint":
        return open_checkpoint(path, mesh=mesh, tokenizer=tokenizer, with_tokenizer=with_tokenizer)
    name = path or (config.model.path if kind == "config" else "smollm2") or config.model.source
    if kind == "hf" and path is not None and is_remote(as_path(path)):
        path = str(local_copy(path))
    if kind != "config":
        config = config.model_copy(update={"model": model_section(config, kind, path)})
    config = with_tokenizer_named(config, tokenizer)
    model, own = load_model(config.model, seed=config.seed, mesh=mesh)
    tok = None
    if with_tokenizer:
        m = config.model
        # a GGUF's own tokenizer was checked against its model by read_gguf
        tok = own if own is not None and config.data.tokenizer is None else fitting_tokenizer(
            config, model, model_from=str(m.path or f"model.source={m.source}"))
    return OpenedModel(model, tok, config, kind, {"model": str(name)})


def local_copy(source: str) -> Path:
    """A local copy of the model directory `source` (a `gs://` one: transformers and the
    tokenizers read local files), removed when the process exits (every later read of it,
    tokenizer or export, is in this process; left behind, each `--model gs://…` would leave a
    full model in the temporary directory)."""
    local = Path(tempfile.mkdtemp(prefix="jaxrl-model-"))
    atexit.register(shutil.rmtree, local, ignore_errors=True)
    copy_tree(as_path(source), local)
    return local


def open_checkpoint(path: str, *, step: int | None = None, mesh: Any = None,
                    tokenizer: str | None = None, with_tokenizer: bool = True) -> OpenedModel:
    """The policy of a training checkpoint (a run directory, its `checkpoints/`, or one step
    directory; `step`: that step, default the latest) with the tokenizer it was trained with
    (or `tokenizer`), in the configuration stored next to it."""
    restored = restore_model(path, step=step, mesh=mesh)
    tok = fitting_tokenizer(with_tokenizer_named(restored.config, tokenizer), restored.model,
                            model_from=str(path)) if with_tokenizer else None
    return OpenedModel(restored.model, tok, restored.config, "checkpoint",
                       {"model": str(path), "step": restored.step})


def open_tokenizer(config: Any) -> Any:
    """The tokenizer `open_model(None, config)` pairs with the config's model (`data.tokenizer`,
    else the source's own), without loading the model."""
    return load_tokenizer(config.model, config.data.tokenizer)


def with_tokenizer_named(config: Any, tokenizer: str | None) -> Any:
    """`config` with `data.tokenizer` set to `tokenizer` (unchanged when None)."""
    if tokenizer is None:
        return config
    return config.model_copy(update={"data": config.data.model_copy(update={"tokenizer": tokenizer})})


def fitting_tokenizer(config: Any, model: Any, *, model_from: str) -> Any:
    """`open_tokenizer(config)`, refused (naming both files) when it has more tokens than
    `model`'s embedding table."""
    tok = open_tokenizer(config)
    check_tokenizer_fits(tok, model.config.vocab_size,
                         tokenizer_from=str(config.data.tokenizer or config.model.path or "char"),
                         model_from=model_from)
    return tok
