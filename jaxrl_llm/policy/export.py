"""`jaxrl-llm export --checkpoint DIR --out HF_DIR`: a training checkpoint as an HF directory
(or, with `--format gguf --gguf-type f16|q8_0 --out FILE.gguf`, one llama.cpp GGUF file,
written by `weights.gguf_export.write_gguf` to a temporary sibling and renamed the same way).
`--from SOURCE` converts a model that was never trained here instead (`export_model`): a
GGUF file, the packaged `smollm2`, a Hub id or an HF directory, through the same loaders
training uses (a GGUF's weights dequantised, llama.cpp's Q/K row order undone).

The parameters are restored from the Orbax checkpoint (gathered from every host in a
multi-host job), written by the models package's exporter (`weights.hf.save_pretrained`:
safetensors + config.json + generation_config.json + tokenizer files) into a temporary
sibling directory, which is then renamed onto `HF_DIR`: a reader never sees a half-written
export, and a crash leaves the previous export (if any) in place. A remote `HF_DIR`
(`gs://…`) is written locally first, then copied file by file (object stores have no atomic
directory rename). A LoRA run (`model.lora`) exports the merged weights (W + (α/r)·A·B) and,
in `HF_DIR/adapter/`, the adapters in PEFT's format (`peft.PeftModel.from_pretrained(base,
HF_DIR/adapter)`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import jax
from etils import epath

from jaxrl_llm.config import ExperimentConfig
from jaxrl_llm.core.atomic import atomic_directory, atomic_file
from jaxrl_llm.core.paths import PathLike, as_path, copy_tree, is_remote
from jaxrl_llm.core.progress import progress_bar
from jaxrl_llm.models.lora import has_adapters
from jaxrl_llm.policy.opener import classify, open_checkpoint, open_model
from jaxrl_llm.weights import hf
from jaxrl_llm.weights.lora_export import save_peft_adapter


def atomic_save(model: Any, out_dir: PathLike, *, tokenizer: Any = None,
                dtype: str | None = None, overwrite: bool = False) -> epath.Path:
    """`hf.save_pretrained` into a temporary directory next to `out_dir`, then rename."""
    target = as_path(out_dir)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists (pass --overwrite to replace it)")
    if is_remote(target):
        return _save_remote(model, target, tokenizer=tokenizer, dtype=dtype)
    _save_local(model, Path(os.fspath(target)), tokenizer=tokenizer, dtype=dtype)
    return target


def _save_local(model: Any, out: Path, *, tokenizer: Any, dtype: str | None,
                shown: str | None = None) -> None:
    """`out` written; the bar names `shown` (default `out`'s folder name) as the target:
    "export to hf/: 3/20 tensors" (a folder named `export` reads "export to export/")."""
    bar = progress_bar(None, desc=f"export to {shown or out.name + '/'}", unit="tensor")

    def on_tensor(done: int, total: int) -> None:
        bar.total = total
        bar.update(done)

    # Built in a temporary sibling, renamed onto `out` when complete (the old export, if
    # any, stays whole until then).
    try:
        with atomic_directory(out, overwrite=True) as tmp:
            hf.save_pretrained(model, tmp, tokenizer=tokenizer, dtype=dtype,
                               generation_config=_special_ids(tokenizer) or None,
                               on_tensor=on_tensor)
            _save_lora_adapter(model, Path(tmp), dtype=dtype)
    finally:
        bar.close()


# Where a LoRA run's export keeps its adapters (beside the merged weights, in a
# subdirectory: an adapter_config.json at the top would make transformers load the
# directory as an adapter instead of as the merged model).
ADAPTER_SUBDIR = "adapter"


def _save_lora_adapter(model: Any, out: Path, *, dtype: str | None) -> None:
    """A LoRA model's adapters in PEFT's format under `out/adapter` (none without LoRA)."""
    if has_adapters(model):
        save_peft_adapter(model, out / ADAPTER_SUBDIR, dtype=dtype)


def _save_remote(model: Any, out: epath.Path, *, tokenizer: Any,
                 dtype: str | None) -> epath.Path:
    """Export into a local temporary directory, then copy every file under `out`."""
    with tempfile.TemporaryDirectory(prefix="jaxrl-export-") as local:
        staged = Path(local) / "export"
        _save_local(model, staged, tokenizer=tokenizer, dtype=dtype, shown=str(out))
        if out.exists():
            out.rmtree()
        return copy_tree(staged, out)


def atomic_save_gguf(model: Any, out_file: PathLike, *, tokenizer: Any, gguf_type: str,
                     overwrite: bool = False) -> epath.Path:
    """`gguf_export.write_gguf` into a temporary file next to `out_file`, then rename (a
    remote `out_file` is written locally, then copied)."""
    from jaxrl_llm.weights.gguf_export import write_gguf

    target = as_path(out_file)
    if target.suffix != ".gguf":
        raise ValueError(f"--out {target} must name a .gguf file for --format gguf")
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists (pass --overwrite to replace it)")
    with atomic_file(target) as tmp:  # temporary sibling, fsync, rename (remote: staged)
        write_gguf(model, tmp, tokenizer=tokenizer, gguf_type=gguf_type)
    return target


def _special_ids(tokenizer: Any) -> dict[str, int]:
    """bos/eos/pad ids of a tokenizer object, for generation_config.json (so `generate`
    stops at the tokenizer's EOS even when the model config does not name it)."""
    ids = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids[name] = value
    return ids


def export_checkpoint(checkpoint: PathLike, out_dir: PathLike, *, step: int | None = None,
                      tokenizer: str | None = None, dtype: str | None = None,
                      overwrite: bool = False, format: str = "hf",
                      gguf_type: str = "f16") -> epath.Path:
    """Restore `checkpoint` (run dir, checkpoints dir or step dir) and export it to `out_dir`
    (format "hf": an HF directory; "gguf": one GGUF file of `gguf_type`)."""
    if format not in ("hf", "gguf"):
        raise ValueError(f"export format {format!r} is not one of ['hf', 'gguf']")
    # the run's own tokenizer, or `tokenizer` (a directory); refused when it outgrows the model
    opened = open_checkpoint(str(checkpoint), step=step, tokenizer=tokenizer)
    if format == "gguf":  # refuse an unsupported architecture/type before any file is made
        from jaxrl_llm.weights.gguf_export import check_exportable

        check_exportable(opened.model.config, gguf_type)
    if jax.process_index() != 0:  # every host restored and gathered; one writes
        return as_path(out_dir)
    if format == "gguf":
        return atomic_save_gguf(opened.model, out_dir, tokenizer=opened.tokenizer,
                                gguf_type=gguf_type, overwrite=overwrite)
    return atomic_save(opened.model, out_dir, tokenizer=opened.tokenizer, dtype=dtype,
                       overwrite=overwrite)


def export_model(source: str, out_dir: PathLike, *, dtype: str | None = None,
                 overwrite: bool = False, format: str = "hf", gguf_type: str = "f16",
                 tokenizer: str | None = None) -> epath.Path:
    """`source` (what `--from` accepts, decided by `opener.open_model`: smollm2, a `.gguf`, an
    HF directory, a Hub id, or a checkpoint) written to `out_dir` like a trained checkpoint's
    export."""
    if classify(source, key="--from")[0] == "checkpoint":
        return export_checkpoint(source, out_dir, tokenizer=tokenizer, dtype=dtype,
                                 overwrite=overwrite, format=format, gguf_type=gguf_type)
    # float32 weights in memory: the export itself writes `dtype`
    opened = open_model(source, ExperimentConfig(model={"param_dtype": "float32"}),
                        tokenizer=tokenizer, key="--from")
    if format == "gguf":
        from jaxrl_llm.weights.gguf_export import check_exportable

        check_exportable(opened.model.config, gguf_type)
        return atomic_save_gguf(opened.model, out_dir, tokenizer=opened.tokenizer,
                                gguf_type=gguf_type, overwrite=overwrite)
    return atomic_save(opened.model, out_dir, tokenizer=opened.tokenizer, dtype=dtype,
                       overwrite=overwrite)
