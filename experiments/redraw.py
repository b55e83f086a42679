"""Figures drawn only from committed results, so a figure and the table beside it cannot drift.

A finished non-smoke run (`common.run_experiment`, or a script's own `main`) writes, beside
`OUT/NAME.png`, the results it was drawn from to `experiments/results/NAME.json` (`--results-dir`
changes where; `--results-dir none` skips it), and stamps the PNG with the SHA-256 of those
results (a PNG `tEXt` chunk, `results_sha256`). Copy a figure into `experiments/figures/` under
the stem of its results file; tests/experiments/test_figures.py redraws every figure that has
one and checks the drawn series and seed counts against the JSON and the stamp against it.

    python experiments/redraw.py NAME [--results PATH] --out DIR

redraws `DIR/NAME.png` from `experiments/results/NAME.json` (or PATH) with the plot function of
the experiment recorded in it (`"experiment"`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import struct
import sys
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script

EXPERIMENTS_DIR = Path(__file__).resolve().parent
RESULTS_DIR = EXPERIMENTS_DIR / "results"
FIGURES_DIR = EXPERIMENTS_DIR / "figures"
STAMP_KEY = "results_sha256"
# a committed results file stays small (they are diffed and reviewed); a run whose results.json
# is larger needs its per-step traces stripped before it is committed
MAX_RESULTS_BYTES = 400_000


def seed_label(seeds: Iterable[int | str]) -> str:
    """'seed 0 only' for one seed, else 'N seeds': a label computed from the seeds drawn."""
    seeds = sorted({int(s) for s in seeds})
    if not seeds:
        raise ValueError("seed_label: no seeds")
    return f"seed {seeds[0]} only" if len(seeds) == 1 else f"{len(seeds)} seeds"


def digest(results: dict[str, Any]) -> str:
    """SHA-256 of the results as they read back from JSON (key order and tuples don't matter)."""
    canonical = json.dumps(json.loads(json.dumps(results)), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _chunks(data: bytes, where: Path) -> list[tuple[bytes, bytes]]:
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{where}: not a PNG file")
    out, i = [], 8
    while i < len(data):
        (length,) = struct.unpack(">I", data[i:i + 4])
        out.append((data[i + 4:i + 8], data[i + 8:i + 8 + length]))
        i += 12 + length
    return out


def png_text(path: Path) -> dict[str, str]:
    """The PNG's `tEXt` chunks, key → value."""
    return dict(body.decode("latin-1").split("\0", 1)
                for kind, body in _chunks(path.read_bytes(), path) if kind == b"tEXt")


def stamp_png(path: Path, value: str, key: str = STAMP_KEY) -> None:
    """Insert (or replace) a `tEXt` chunk KEY=VALUE right after the PNG's header chunk."""
    chunks = [(k, b) for k, b in _chunks(path.read_bytes(), path)
              if not (k == b"tEXt" and b.split(b"\0", 1)[0] == key.encode())]
    chunks.insert(1, (b"tEXt", key.encode() + b"\0" + value.encode("latin-1")))
    out = bytearray(b"\x89PNG\r\n\x1a\n")
    for kind, body in chunks:
        out += struct.pack(">I", len(body)) + kind + body
        out += struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    path.write_bytes(bytes(out))


def plot_function(experiment: str) -> Callable[[dict[str, Any], Path], Any]:
    """`experiments/EXPERIMENT.py`'s `plot` (the one function that draws its figure)."""
    if not (EXPERIMENTS_DIR / f"{experiment}.py").exists():
        raise ValueError(f"results name experiment {experiment!r}: no experiments/"
                         f"{experiment}.py")
    return importlib.import_module(f"experiments.{experiment}").plot


def draw(experiment: str, results: dict[str, Any], png: Path, results_dir: Path | None = None,
         plot: Callable[[dict[str, Any], Path], Any] | None = None) -> Any:
    """Draw `png` from `results` with the experiment's plot function (`plot`, else
    `plot_function(experiment)`) and stamp it; with `results_dir`, also write
    `results_dir/<png stem>.json` (the results plus `experiment`). Returns the plot
    function's Figure (closed; its artists still hold what was drawn)."""
    fig = (plot or plot_function(experiment))(results, png)
    stamp_png(png, digest(results))
    if results_dir is not None:
        results_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"experiment": experiment, **results}, indent=1)
        path = results_dir / f"{png.stem}.json"
        path.write_text(text + "\n")
        over = len(text) > MAX_RESULTS_BYTES
        print(f"wrote {path} ({len(text)} bytes)" + (
            f"; over {MAX_RESULTS_BYTES}: strip per-step traces before committing" if over
            else ""))
    return fig


def load(path: Path) -> tuple[str, dict[str, Any]]:
    """(experiment, results) of a committed results file; the results exclude `experiment`."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "experiment" not in data:
        raise ValueError(f"{path}: no 'experiment' key (which experiments/*.py drew it)")
    experiment = data.pop("experiment")
    return experiment, data


def redraw(results_path: Path, out: Path, name: str | None = None) -> tuple[Path, Any]:
    """`out/<name or results stem>.png` redrawn from a committed results file."""
    experiment, results = load(results_path)
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"{name or results_path.stem}.png"
    return png, draw(experiment, results, png)


def results_dir_arg(value: str | None, smoke: bool) -> Path | None:
    """`--results-dir`: default `experiments/results` for full runs, none for smoke runs."""
    if value is None:
        return None if smoke else RESULTS_DIR
    return None if value == "none" else Path(value).resolve()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the figure's stem: experiments/results/NAME.json")
    parser.add_argument("--results", default=None, help="results file (default: "
                        "experiments/results/NAME.json)")
    parser.add_argument("--out", required=True, help="directory for NAME.png")
    args = parser.parse_args(argv)
    path = Path(args.results) if args.results else RESULTS_DIR / f"{args.name}.json"
    if not path.exists():
        raise SystemExit(f"{path}: no such results file")
    png, _ = redraw(path, Path(args.out), args.name)
    print(f"redrew {png} from {path}")


if __name__ == "__main__":
    main()
