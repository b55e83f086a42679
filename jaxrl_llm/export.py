"""`jaxrl-llm export --checkpoint DIR --out HF_DIR`: a training checkpoint as an HF directory.

The parameters are restored from the Orbax checkpoint (gathered from every host in a
multi-host job), written by the models package's exporter (`models.hf.save_pretrained`:
safetensors + config.json + generation_config.json + tokenizer files) into a temporary
sibling directory, which is then renamed onto `HF_DIR`: a reader never sees a half-written
export, and a crash leaves the previous export (if any) in place. A remote `HF_DIR`
(`gs://…`) is written locally first, then copied file by file (object stores have no atomic
directory rename).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from etils import epath

from jaxrl_llm.paths import PathLike, as_path, copy_tree, is_remote


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


def _save_local(model: Any, out: Path, *, tokenizer: Any, dtype: str | None) -> None:
    from jaxrl_llm.models import hf

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        hf.save_pretrained(model, tmp, tokenizer=tokenizer, dtype=dtype,
                           generation_config=_special_ids(tokenizer) or None)
        if out.exists():
            # Two renames: the old export stays whole until the new one is complete.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_remote(model: Any, out: epath.Path, *, tokenizer: Any,
                 dtype: str | None) -> epath.Path:
    """Export into a local temporary directory, then copy every file under `out`."""
    with tempfile.TemporaryDirectory(prefix="jaxrl-export-") as local:
        staged = Path(local) / "export"
        _save_local(model, staged, tokenizer=tokenizer, dtype=dtype)
        if out.exists():
            out.rmtree()
        return copy_tree(staged, out)


def _special_ids(tokenizer: Any) -> dict[str, int]:
    """bos/eos/pad ids of a tokenizer object, for generation_config.json (so `generate`
    stops at the tokenizer's EOS even when the model config does not name it)."""
    ids = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids[name] = value
    return ids


def tokenizer_for(config: Any, tokenizer: str | None) -> Any:
    """The tokenizer to ship with an export: `--tokenizer DIR`, else the run's own."""
    if tokenizer is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    from jaxrl_llm.generate.loading import tokenizer_from_config

    return tokenizer_from_config(config)


def export_checkpoint(checkpoint: PathLike, out_dir: PathLike, *, step: int | None = None,
                      tokenizer: str | None = None, dtype: str | None = None,
                      overwrite: bool = False) -> epath.Path:
    """Restore `checkpoint` (run dir, checkpoints dir or step dir) and export it to `out_dir`."""
    import jax

    from jaxrl_llm.train.checkpoint import restore_model

    restored = restore_model(checkpoint, step=step)
    tok = tokenizer_for(restored.config, tokenizer)
    if jax.process_index() != 0:  # every host restored and gathered; one writes
        return as_path(out_dir)
    return atomic_save(restored.model, out_dir, tokenizer=tok, dtype=dtype, overwrite=overwrite)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="run directory, its checkpoints/ directory, or checkpoints/<step>")
    parser.add_argument("--out", required=True, help="HF directory to write")
    parser.add_argument("--step", type=int, default=None, help="default: the latest complete")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory to include (default: the run's tokenizer)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing HF_DIR")


def run(args: argparse.Namespace) -> int:
    out = export_checkpoint(args.checkpoint, args.out, step=args.step, tokenizer=args.tokenizer,
                            dtype=args.dtype, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} -> {out}")
    return 0
