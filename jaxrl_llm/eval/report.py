"""`jaxrl-llm report RUN_DIR`: PNG plots and a Markdown summary of a run.

Reads what the other commands write under the run directory:
- every `metrics.jsonl` (trainer rows: `{"step": s, metric: value, ...}`); with several
  (SFT, one per `iterate` iteration) each metric is prefixed with its file's directory;
- every `eval.json` (written by `evaluate` numbers), labelled by its `label` field or
  its directory relative to the run directory; one carrying a `step` also contributes a
  point to the accuracy-vs-step plot.
Writes `report/*.png` and `report/report.md` (or under `--out`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from etils import epath

from jaxrl_llm.core.atomic import atomic_write_text
from jaxrl_llm.core.paths import PathLike, as_path, find_files
from jaxrl_llm.tasks.loading import read_jsonl

# (file stem, title, y label, metric-name regexes)
SERIES = (
    ("accuracy", "Accuracy vs step", "accuracy (fraction of samples correct)",
     (r"(^|/)pass_at_1$", r"(^|/)pass_at_1_se$", r"solve_rate$")),
    # DPO/RPO's `reward_accuracy` counts pairs, not samples: its own panel and label.
    ("pair_accuracy", "Preference pairs ranked right (DPO arXiv:2305.18290)",
     "fraction of pairs with implicit reward(chosen) > reward(rejected)", (r"reward_accuracy$",)),
    ("loss", "Loss vs step", "loss (nats)", (r"(^|/)loss$", r"objective$")),
    ("reward", "Reward of the trained records", "reward (mean, std over the batch)",
     (r"(^|/)reward/(mean|std)$",)),
    ("kl", "KL to the sampler μ and to π_ref (k3 estimates)", "nats per token", (r"(^|/)kl/",)),
    ("entropy", "Policy entropy", "nats per token", (r"(^|/)entropy$",)),
    ("completion_length", "Completion length", "tokens per record", (r"(^|/)completion_length$",)),
    ("grad_norm", "Gradient norm (before clipping)", "‖g‖₂",
     (r"(^|/)grad_norm(_positive|_negative)?$",)),
    ("learning_rate", "Learning rate", "learning rate", (r"(^|/)learning_rate$",)),
    ("throughput", "Throughput", "tokens per second", (r"(^|/)throughput/tokens_per_s$",)),
    # The TOPR-family kernels report log(π/μ) split by sign; FPA π^{1/|y|} by correctness.
    ("logprob_drift", "Log-prob drift: correct vs incorrect (FPA arXiv:2509.19893 Fig. 2)", "log π − log μ (nats); FPA: π^(1/|y|)",
     (r"drift", r"log_ratio_mean_(pos|neg)$", r"pi(_hat)?_norm_mean_(correct|incorrect)$")),
    ("clipped_fractions", "Clipped fractions", "fraction of records in the batch", (r"clip",)),
    # `online.pipeline` (docs/online.md § Pipeline): how stale each trained sample was and
    # where each side's time went (`step` is the online round)
    ("pipeline_lag", "Version lag of the trained samples (online pipeline)",
     "updates between the sampling weights and the update", (r"(^|/)pipeline/lag_(min|mean|max)$",)),
    ("pipeline_lag_histogram", "Samples trained at each version lag (online pipeline)",
     "samples in the round at lag L", (r"(^|/)pipeline/lag_hist_\d+$",)),
    ("pipeline_samples", "Samples handed over, trained, dropped as too stale (free-running pipeline)",
     "samples (running totals)", (r"(^|/)pipeline/(received|trained|dropped)_total$",)),
    ("pipeline_seconds", "Busy, waiting and syncing weights, per side (online pipeline)",
     "seconds in the round", (r"(^|/)pipeline/(sampler|trainer)_(busy|wait|sync)_s$",
                              r"(^|/)pipeline/sync_pause_max_s$")),
    ("effective_positive_fraction", "Effective positive fraction (TOPR arXiv:2503.14286 eq. 12)", "p̃ (fraction of the batch's weight)",
     (r"effective_pos",)),
)


def collect_run(run_dir: PathLike) -> tuple[list[dict[str, object]], dict[str, dict[str, object]]]:
    """(metric rows sorted by step, {label: eval dict}) of everything under `run_dir`."""
    run_dir = as_path(run_dir)
    rows: list[dict[str, object]] = []
    paths = find_files(run_dir, "metrics.jsonl")
    # An SFT warm start (quickstart, iterate with sft:) counts its own steps from 0: its rows
    # get phase "sft" and the rest "rl", and the plots draw the two in separate panels.
    sft_dirs = {p for p in paths if _relative(p.parent, run_dir).startswith("sft")}
    phased = bool(sft_dirs) and len(paths) > 1
    for path in paths:
        file_rows = read_jsonl(path)
        if len(paths) > 1 and path.parent != run_dir:
            # Several trainings (SFT, iterations): name each series after its directory.
            prefix = path.parent.relative_to(run_dir).as_posix()
            file_rows = [{k if k in ("step", "time") else f"{prefix}/{k}": v
                          for k, v in row.items()} for row in file_rows]
        if phased:
            file_rows = [{**row, "phase": "sft" if path in sft_dirs else "rl"} for row in file_rows]
        rows.extend(file_rows)
    evals: dict[str, dict[str, object]] = {}
    for path in find_files(run_dir, "eval.json"):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON: {err}") from err
        label = str(data.get("label") or path.parent.relative_to(run_dir).as_posix() or "eval")
        evals[label] = data
        if isinstance(data.get("step"), int) and isinstance(data.get("pass_at_1"), dict):
            p1 = data["pass_at_1"]
            rows.append({"step": data["step"], "eval/pass_at_1": p1["mean"],
                         "eval/pass_at_1_se": p1["se"], **({"phase": "rl"} if phased else {})})
    rows.sort(key=lambda r: r.get("step", 0))  # type: ignore[arg-type, return-value]
    return rows, evals


def _relative(path: epath.Path, root: epath.Path) -> str:
    return "" if path == root else path.relative_to(root).as_posix()


def _fmt(x: object, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def eval_table(evals: Mapping[str, Mapping[str, object]]) -> list[str]:
    """Markdown table: pass@1 ± SE, pass@k at the largest k, maj@K ± 2 SE, invalid rate."""
    lines = ["| evaluation | questions × n | pass@1 ± SE | pass@n | maj@K ± 2 SE | invalid |",
             "| --- | --- | --- | --- | --- | --- |"]
    for label, e in evals.items():
        p1 = e.get("pass_at_1") or {}
        curve = e.get("pass_at_k") or {}
        top = curve[str(max(int(k) for k in curve))] if curve else None  # type: ignore[index]
        maj = "; ".join(
            f"@{k}: {_fmt(v['mean'])} ± {_fmt(v.get('error_bar'))}"
            for k, v in (e.get("maj_at_k") or {}).items()  # type: ignore[union-attr]
        )
        props = e.get("proportions") or {}
        lines.append(
            f"| {label} | {e.get('num_questions', '?')} × {e.get('n', '?')} | "
            f"{_fmt(p1.get('mean'))} ± {_fmt(p1.get('se'))} | {_fmt(top)} | {maj or '–'} | "  # type: ignore[union-attr]
            f"{_fmt(props.get('invalid'))} |"  # type: ignore[union-attr]
        )
    return lines


def write_report(run_dir: PathLike, out_dir: PathLike | None = None) -> epath.Path:
    """Render every plot the run has data for and a Markdown summary; returns the .md path."""
    from jaxrl_llm.eval import plots  # matplotlib loads only when a report is drawn

    run = as_path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist")
    out = as_path(out_dir) if out_dir is not None else run / "report"
    rows, evals = collect_run(run)
    if not rows and not evals:
        raise FileNotFoundError(f"{run} holds no metrics.jsonl or eval.json to report on")
    figures: list[tuple[str, epath.Path | None]] = []
    for stem, title, ylabel, patterns in SERIES:
        figures.append((title, plots.series_plot(rows, patterns, out / f"{stem}.png",
                                                 title=title, ylabel=ylabel)))
    figures.append(("pass@k vs k", plots.pass_at_k_plot(evals, out / "pass_at_k.png")))
    figures.append(("Correct-answer cardinality",
                    plots.cardinality_plot(evals, out / "cardinality.png")))
    figures.append(("Correct / incorrect / invalid",
                    plots.proportions_plot(evals, out / "proportions.png")))

    md = [f"# Run report: `{run}`", ""]
    if rows:
        last = max((r for r in rows if "step" in r), key=lambda r: r["step"], default=None)  # type: ignore[arg-type, return-value]
        md.append(f"{len(rows)} metric rows; last step {last['step'] if last else '?'}.")
        md.append("")
    if evals:
        md += ["## Evaluations", "", *eval_table(evals), ""]
    md += ["## Plots", ""]
    for title, path in figures:
        if path is None:
            md += [f"- {title}: no data in this run", ""]
        else:
            md += [f"### {title}", "", f"![{title}]({path.relative_to(out).as_posix()})", ""]
    report = out / "report.md"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(report, "\n".join(md) + "\n")
    return report
