"""Seconds per weight sync against model size, in memory and through storage.

A sync is the hand-over of the trainer's newest weights to the sampler:

- **in memory** (`online.sampler_devices`, one host): `online.placement.Placement.publish`,
  the resharding `device_put` from the trainer's devices (mesh fsdp 4) to the sampler's
  decode layout on its 2 devices (2 slot groups: the weights whole on each, in the sampling
  dtype), waited for — what the pipeline's trainer pauses for;
- **through storage** (rollout workers sharing only a directory): the trainer writes the
  version atomically, the sampler reads it onto its own devices. Two writers of the project:
  Orbax (`train.checkpoint.Checkpointer`: a step committed atomically, old steps
  garbage-collected), read with a restore onto the sampler's shardings; and the HF safetensors
  export (`weights.hf_export.save_pretrained` into `core.atomic.atomic_directory`: what vLLM
  reloads), read with `weights.hf.load_pretrained` straight onto the sampler's mesh;
- **exchange** (what `jaxrl-llm online --role trainer / --role worker` do, online/remote.py):
  the trainer's own `StorageTrainer.publish` (this process's shards in the sampling dtype,
  no gather: one `weights/vNNNNNNNN-pPPPofNNN.bin` part per trainer process, written
  atomically with its SHA-256) and a worker's own `StoredWeights.take` (every part read, size
  and checksum checked, assembled, checked against its model, put straight into its decode
  layout).

6 fake CPU devices (4 train, 2 sample: every dimension of these models splits evenly) on this
host; storage is its local disk, read right after writing (page cache warm: a second host
reading over NFS or gs:// pays the network). Each model size runs in its own subprocess
(its peak RSS is reported); every sync's result is checked equal to the trainer's weights,
bit for bit. Each path peaks at ≈ 4× the weights' bytes here (two copies and the transfer's
buffers), so the 1.5B shape is measured with 10 of its 28 layers, and the full 1.5B and
Llama-3-8B (16 GB in bfloat16) rows are an **extrapolation** from the bytes per second
measured on the largest model, labelled so.

    python benchmarks/weight_sync.py [--models smollm2 qwen25_05b qwen25_15b_10l] [--repeats 3]
        [--dtype bfloat16] [--dir /tmp] [--smoke] [--note TEXT]
        [--out benchmarks/results/weight_sync.json]
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax is imported (the child imports it in `measure`)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=6").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import cpu_name  # noqa: E402  benchmarks/, this script's directory

TRAINER_DEVICES, SAMPLER_DEVICES = 4, 2
# Architectures (HF config.json values); the weights are random except SmolLM2's.
QWEN25 = dict(family="qwen2", vocab_size=151936, num_kv_heads=2, rope_theta=1000000.0,
              rms_norm_eps=1e-6, tie_embeddings=True, max_position_embeddings=32768)
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                  head_dim=128)
MODELS: dict[str, dict[str, Any]] = {
    "smollm2": {"source": "smollm2"},  # the packaged SmolLM2-135M-Instruct, real weights
    "qwen25_05b": {**QWEN25, "hidden_size": 896, "intermediate_size": 4864, "num_layers": 24,
                   "num_heads": 14, "head_dim": 64},
    # the 1.5B shape with 10 of its 28 layers: the full model's ≈ 4× peak (trainer copy, sampler
    # copy, the transfer's host buffers) would not fit this machine's share of memory
    "qwen25_15b_10l": {**QWEN25, **QWEN25_15B, "num_layers": 10},
    "tiny": {"family": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
}
LLAMA3_8B = dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                 max_position_embeddings=8192, rope_theta=500000.0, tie_embeddings=False)
LABELS = {"smollm2": "SmolLM2-135M (real)", "qwen25_05b": "Qwen2.5-0.5B shape (random)",
          "qwen25_15b_10l": "Qwen2.5-1.5B shape, 10 of 28 layers (random)",
          "tiny": "tiny (random)", "qwen25_15b": "Qwen2.5-1.5B shape (extrapolated)",
          "llama3_8b": "Llama-3-8B shape (extrapolated)"}
EXTRAPOLATED = {"qwen25_15b": {**QWEN25, **QWEN25_15B}, "llama3_8b": LLAMA3_8B}
PATHS = ("in_memory", "orbax", "safetensors", "exchange")


def _config(model: dict[str, Any], dtype: str) -> Any:
    from jaxrl_llm.config import config_from_dict
    from jaxrl_llm.online.config import OnlineConfig

    source = {"source": "random"} if "source" not in model else {}
    return config_from_dict({
        "model": {**source, **model, "param_dtype": dtype, "scan_layers": True},
        "mesh": {"data": 1, "fsdp": -1, "tensor": 1},
        "online": {"sampler_devices": SAMPLER_DEVICES},
    }, schema=OnlineConfig)


def _digests(tree: Any) -> list[str]:
    """A digest of every leaf's bytes, its shape and dtype (one leaf on the host at a time)."""
    import hashlib

    import jax
    import numpy as np

    return [f"{x.shape}/{x.dtype}/" + hashlib.blake2b(np.asarray(x).tobytes(), digest_size=16)
            .hexdigest() for x in jax.tree.leaves(tree)]


def _timed(fn: Any, repeats: int) -> list[float]:
    """One warm-up call (compiles, first file creation), then `repeats` timed ones."""
    fn(0)
    times = []
    for i in range(1, repeats + 1):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
    return times


def trainer_weights(name: str, dtype: str) -> tuple[Any, Any, Any, Any]:
    """(placement, model, params, other state) on the trainer's devices. Random shapes are
    filled from numpy one leaf at a time (normal, σ 0.02): the model's own jitted initialiser
    holds ≈ 5× the weights' bytes at its peak, which a 1.5B model would not fit here."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxrl_llm.online.placement import make_placement
    from jaxrl_llm.parallel.rules import state_shardings
    from jaxrl_llm.train.state import build_model, split_model

    config = _config(MODELS[name], dtype)
    placement = make_placement(config, jax.devices())
    if config.model.source != "random":
        model = build_model(config, mesh=placement.trainer)
        _, params, rest = split_model(model)
        return placement, model, params, rest
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: build_model(config, weights=False))
    graphdef, shapes, rest_shapes = split_model(abstract)
    rng = np.random.default_rng(0)

    def fill(x: Any, sharding: Any) -> Any:
        out = np.empty(x.shape, x.dtype)
        for i in range(x.shape[0] if x.ndim > 1 else 1):  # one layer (or row block) at a time
            part = out[i] if x.ndim > 1 else out
            part[...] = 0.02 * rng.standard_normal(part.shape, np.float32)
        return jax.block_until_ready(jax.device_put(out, sharding))

    params = jax.tree.map(fill, shapes, state_shardings(shapes, placement.trainer))
    rest = jax.tree.map(fill, rest_shapes, state_shardings(rest_shapes, placement.trainer))
    return placement, nnx.merge(graphdef, params, rest), params, rest


def exchange_sides(name: str, dtype: str, placement: Any, model: Any, params: Any, rest: Any,
                   root: Path) -> tuple[Any, Any]:
    """(trainer, worker weights): the storage pipeline's own two sides (online/remote.py) over
    an exchange at `root`, the trainer holding `params`/`rest` and publishing its part in the
    sampling dtype; the worker's side is built from their shapes alone (a second host holds no
    copy of the trainer's) and loads each version straight into its decode layout."""
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.api import Policy
    from jaxrl_llm.online.exchange import Exchange
    from jaxrl_llm.online.remote import StorageTrainer, StoredWeights
    from jaxrl_llm.online.run_state import RunState
    from jaxrl_llm.sampling.layout import sampling_dtype
    from jaxrl_llm.train.state import TrainState

    config = _config(MODELS[name], dtype)
    ex = Exchange(str(root), timeout_s=60.0)
    manifest = {"model": name, "run_id": "benchmark", "about": {"name": name, "run_dir": ""}}
    sampling = sampling_dtype(model)

    def policy(p: Any, r: Any) -> Any:  # no optimizer state: publish reads params, model_state
        state = TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=None,
                           model_state=r, ref_params=None, rng=None, graphdef=None,
                           param_dtypes=())
        return Policy(config, state, None, placement.trainer)
    trainer = StorageTrainer(config=config, experiment=None, placement=placement,
                             policy=policy(params, rest), run=RunState(0), meta={},
                             checkpointer=None, side=None, weights=None, ex=ex,
                             manifest=manifest, dtype=sampling, incarnation="benchmark")
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, rest))
    layout = placement.sampler_layout(model.config.num_kv_heads)
    return trainer, StoredWeights(ex, shapes, layout.weight_shardings(shapes), manifest,
                                  sampling)


def measure(name: str, path: str, dtype: str, repeats: int, directory: Path) -> dict[str, Any]:
    """One model size and one sync path, in this process (6 CPU devices). Storage: the
    trainer side writes every version, then drops its weights; the sampler side loads each
    (a second host would hold only its own copy)."""
    import gc

    import jax

    from jaxrl_llm.core.atomic import atomic_directory
    from jaxrl_llm.parallel.rules import state_shardings
    from jaxrl_llm.train.checkpoint import Checkpointer, abstract_like
    from jaxrl_llm.train.state import split_model
    from jaxrl_llm.weights.hf import load_pretrained
    from jaxrl_llm.weights.hf_export import save_pretrained

    placement, model, params, rest = trainer_weights(name, dtype)
    nbytes = sum(x.nbytes for x in jax.tree.leaves((params, rest)))
    row: dict[str, Any] = {"params": sum(int(x.size) for x in jax.tree.leaves(params)),
                           "bytes": int(nbytes)}
    expected = _digests(params)
    if path == "in_memory":
        moved: list[Any] = []

        from jaxrl_llm.sampling.layout import sampling_dtype

        # what the pipeline publishes: the sampler's decode layout, in the sampling dtype
        decode = (placement.sampler_layout(model.config.num_kv_heads), sampling_dtype(model))

        def publish(i: int) -> None:
            moved.clear()  # the previous copy is freed first
            moved.append(placement.publish(params, rest, *decode))
        times = _timed(publish, repeats)
        row.update(sync_s=times, equal=_digests(moved[0][0]) == expected)
    else:
        root = directory / f"{name}-{path}"
        target = abstract_like(params, state_shardings(params, placement.sampler))
        ckpt = Checkpointer(root, save_every=1, keep=repeats + 1, async_save=False)
        trainer: Any = None
        worker: Any = None
        if path == "exchange":
            trainer, worker = exchange_sides(name, dtype, placement, model, params, rest, root)

        def save(i: int) -> None:
            if path == "exchange":  # version i + 1: the trainer's publish after update i + 1
                trainer.run.updates = i + 1
                trainer.publish()
            elif path == "orbax":
                ckpt.save(i + 1, {"params": params}, force=True)
                ckpt.wait()
            else:
                with atomic_directory(root / f"v{i}") as tmp:
                    save_pretrained(model, tmp)

        def load(i: int) -> Any:
            if path == "exchange":
                out = worker.take(i + 1)[0]  # (params, model state) on the sampler's devices
            elif path == "orbax":
                out = ckpt.restore({"params": target}, step=i + 1).state["params"]
            else:
                out = split_model(load_pretrained(root / f"v{i}", mesh=placement.sampler,
                                                  scan_layers=True))[1]
            return jax.block_until_ready(out)
        save_s = _timed(save, repeats)
        del model, params, rest, trainer  # the trainer's side ends here (its policy held them)
        gc.collect()
        loaded: list[Any] = []

        def reload(i: int) -> None:
            loaded.clear()
            loaded.append(load(i))
        load_s = _timed(reload, repeats)
        ckpt.close()
        row.update(save_s=save_s, load_s=load_s, equal=_digests(loaded[0]) == expected)
        loaded.clear()
        shutil.rmtree(root, ignore_errors=True)
    for key in ("sync_s", "save_s", "load_s"):
        if key in row:
            row[key.replace("_s", "_median_s")] = statistics.median(row[key])
    if path != "in_memory":  # a sync is one save and one load
        row["sync_median_s"] = row["save_median_s"] + row["load_median_s"]
    row["gb_per_s"] = nbytes / row["sync_median_s"] / 1e9
    row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return row


def abstract_bytes(model: dict[str, Any], dtype: str) -> tuple[int, int]:
    """(parameters, bytes) of a model shape, from an abstract model (no weights made)."""
    import jax
    from flax import nnx

    from jaxrl_llm.train.state import build_model

    config = _config(model, dtype)
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: build_model(config, weights=False))
    leaves = jax.tree.leaves(nnx.state(abstract))
    params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    return params, sum(int(x.size) * x.dtype.itemsize for x in leaves)


def extrapolate(name: str, largest: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Model `name`'s seconds per sync at the GB/s measured on `largest` (NOT measured)."""
    count, nbytes = abstract_bytes(EXTRAPOLATED[name], dtype)
    row: dict[str, Any] = {"model": name, "label": LABELS[name], "params": count,
                           "bytes": nbytes, "dtype": dtype, "extrapolated_from": largest["model"]}
    for path in PATHS:
        rate = largest[path]["gb_per_s"]
        row[path] = {"sync_median_s": nbytes / (rate * 1e9), "gb_per_s": rate}
    return row


def table(result: dict[str, Any]) -> str:
    lines = ["| model | parameters | bytes | in memory | GB/s | Orbax: save + load | GB/s | "
             "safetensors: save + load | GB/s | exchange: publish + take | GB/s | "
             "storage ÷ in memory (Orbax / safetensors / exchange) | peak RSS |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- "
             "| ---: |"]
    for row in result["rows"] + result["extrapolated"]:
        mem, orb, st, ex = (row[p] for p in PATHS)

        def split(r: dict[str, Any]) -> str:
            if "save_median_s" not in r:
                return f"{r['sync_median_s']:.2f} s"
            return (f"{r['sync_median_s']:.2f} s ({r['save_median_s']:.2f} + "
                    f"{r['load_median_s']:.2f})")
        peak = (f"{max(row[p]['peak_rss_gib'] for p in PATHS):.1f} GiB"
                if "peak_rss_gib" in mem else "—")
        lines.append(
            f"| {row['label']} | {row['params'] / 1e6:,.0f} M | {row['bytes'] / 1e9:.2f} GB | "
            f"{mem['sync_median_s']:.3f} s | {mem['gb_per_s']:.2f} | {split(orb)} | "
            f"{orb['gb_per_s']:.2f} | {split(st)} | {st['gb_per_s']:.2f} | {split(ex)} | "
            f"{ex['gb_per_s']:.2f} | "
            + " / ".join(f"{r['sync_median_s'] / mem['sync_median_s']:.0f}×"
                         for r in (orb, st, ex)) + f" | {peak} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "qwen25_05b", "qwen25_15b_10l"],
                        choices=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the storage syncs write (a local disk here)")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 1 repeat")
    parser.add_argument("--note", default="", help="the run's conditions (other jobs on the "
                        "host), recorded in the result's `machine`")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/weight_sync.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child: measure this model …
    parser.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)  # … by this path
    args = parser.parse_args()
    if args.smoke:
        args.models, args.repeats = ["tiny"], 1
    if args.one:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="weight_sync-") as work:
            row = measure(args.one, args.path, args.dtype, args.repeats, Path(work))
        print(json.dumps(row))
        return 0
    rows = []
    load_before = os.getloadavg()
    for name in args.models:
        row: dict[str, Any] = {"model": name, "label": LABELS[name], "dtype": args.dtype}
        for path in PATHS:  # each in its own process: its peak memory is its own
            print(f"{name}, {path} …", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "--one", name, "--path", path,
                                  "--repeats", str(args.repeats), "--dtype", args.dtype,
                                  "--dir", args.dir], capture_output=True, text=True,
                                 check=False)
            if out.returncode != 0:
                print(out.stderr[-4000:], file=sys.stderr)
                return out.returncode
            measured = json.loads(out.stdout.strip().splitlines()[-1])
            row["params"], row["bytes"] = measured.pop("params"), measured.pop("bytes")
            row[path] = measured
            print(json.dumps(measured), file=sys.stderr)
        rows.append(row)
    largest = max(rows, key=lambda r: r["bytes"])
    result = {
        "benchmark": "seconds per weight sync, trainer (4 CPU devices, fsdp 4) → sampler "
                     "(2 CPU devices): in memory (Placement.publish, a resharding "
                     "device_put into the sampler's decode layout: 2 slot groups, the weights "
                     "whole on each, in the sampling dtype) and through local storage (fsdp 2) (atomic Orbax step / atomic HF "
                     "safetensors directory / the online exchange's weight blob written by "
                     "StorageTrainer.publish and read by StoredWeights.take, then loaded onto "
                     "the sampler's devices; a sync = "
                     "median save + median load); medians of "
                     f"{args.repeats} after one warm-up; each path of each model in its own "
                     "process; every sync checked bit-equal to the trainer's weights",
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "fake_devices": TRAINER_DEVICES + SAMPLER_DEVICES,
                    "storage": "local disk, read right after the write (page cache warm)",
                    "load_average_before": list(load_before),
                    "load_average_after": list(os.getloadavg()), "note": args.note},
        "repeats": args.repeats,
        "rows": rows,
        "extrapolated": [extrapolate(name, largest, args.dtype) for name in EXTRAPOLATED],
        "note": "the `extrapolated` rows (the full Qwen2.5-1.5B shape, Llama-3-8B) are an "
                "EXTRAPOLATION, not measured: each one's exact byte count (abstract model) "
                "divided by the GB/s measured on the largest measured model; neither fits "
                "this machine's share of memory (≈ 4× the weights at the peak of each path)",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out).with_suffix(".md").write_text(table(result))
    print(table(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
