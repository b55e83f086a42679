"""PKPO (arXiv:2505.15201) 1-D toy: variance of the max@k policy-gradient estimate
`Σ_i t_i ∇θ log p(x_i; θ)` with the reward transforms t = s (eq. 19, no baseline), sloo
(eq. 29, leave-one-out baseline at k) and sloo_minus_one (eq. 33, baseline at k − 1).

Policy x ~ N(θ, σ²), σ = 0.1; reward g(x) = x² on [0, 1], else 0. Each trial draws n samples,
transforms their rewards with `jaxrl_llm.losses.pkpo` and forms the score-function gradient
(∇θ log p = (x − θ)/σ²). Over many trials: mean (checked against the exact ∇ max@k by
quadrature and a central difference) and variance, vs θ at fixed k and vs k at fixed θ.

    python experiments/pkpo_variance.py --out runs/experiments/pkpo_variance [--smoke]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from experiments import aggregate, common, redraw

TRANSFORMS = ("s", "sloo", "sloo_minus_one")
CONFIG = Path(__file__).with_name("pkpo_variance.yaml")


def reward(x: np.ndarray) -> np.ndarray:
    return np.where((x >= 0.0) & (x <= 1.0), x * x, 0.0)


def exact_max_at_k(theta: float, k: int, sigma: float) -> float:
    """E[max of k rewards] = ∫₀¹ (1 − F(t)^k) dt, F the CDF of g(x): for t ∈ [0, 1),
    F(t) = Φ((√t − θ)/σ) + 1 − Φ((1 − θ)/σ)  (x < 0 and x > 1 give reward 0)."""
    from scipy import integrate, stats

    def survival(t: float) -> float:
        cdf = stats.norm.cdf((np.sqrt(t) - theta) / sigma) + stats.norm.sf((1.0 - theta) / sigma)
        return 1.0 - min(cdf, 1.0) ** k

    return integrate.quad(survival, 0.0, 1.0, limit=200, points=[theta * theta] if 0 < theta < 1 else None)[0]


def exact_gradient(theta: float, k: int, sigma: float, h: float = 1e-4) -> float:
    return (exact_max_at_k(theta + h, k, sigma) - exact_max_at_k(theta - h, k, sigma)) / (2 * h)


def gradient_samples(theta: float, n: int, k: int, sigma: float, trials: int,
                     rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per-trial gradient estimates [trials] for each transform (one group per trial)."""
    from jaxrl_llm.losses import pkpo

    x = theta + sigma * rng.standard_normal((trials, n))
    g = reward(x).astype(np.float32)
    score = (x - theta) / sigma**2
    out = {}
    for name in TRANSFORMS:
        if name == "sloo" and k > n - 1:
            continue  # sloo needs ρ of the n − 1 others at k
        t = np.asarray(getattr(pkpo, name)(g, k), np.float64)
        out[name] = (t * score).sum(axis=1)
    return out


def run(config: dict[str, Any], seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    n, sigma, trials = config["n"], config["sigma"], config["trials"]
    thetas = np.linspace(*config["theta_range"], config["num_thetas"])
    by_theta: dict[str, Any] = {"theta": thetas.tolist(), "k": config["k_for_theta_sweep"]}
    k0 = config["k_for_theta_sweep"]
    exact = [exact_gradient(float(th), k0, sigma) for th in thetas]
    by_theta["exact_gradient"] = exact
    for name in TRANSFORMS:
        by_theta[name] = {"variance": [], "mean": [], "mean_se": []}
    for th in thetas:
        est = gradient_samples(float(th), n, k0, sigma, trials, rng)
        for name, v in est.items():
            by_theta[name]["variance"].append(float(v.var(ddof=1)))
            summary = aggregate.mean_and_se(v)  # over the trials' draws
            by_theta[name]["mean"].append(summary["mean"])
            by_theta[name]["mean_se"].append(summary["se"])
    ks = config["ks"]
    th0 = config["theta_for_k_sweep"]
    by_k: dict[str, Any] = {"k": ks, "theta": th0,
                            "exact_gradient": [exact_gradient(th0, k, sigma) for k in ks]}
    for name in TRANSFORMS:
        by_k[name] = {"k": [], "variance": [], "mean": [], "mean_se": []}
    for k in ks:
        est = gradient_samples(th0, n, k, sigma, trials, rng)
        for name, v in est.items():
            by_k[name]["k"].append(k)
            by_k[name]["variance"].append(float(v.var(ddof=1)))
            summary = aggregate.mean_and_se(v)
            by_k[name]["mean"].append(summary["mean"])
            by_k[name]["mean_se"].append(summary["se"])
    return {"config": config, "seed": seed, "by_theta": by_theta, "by_k": by_k}


def unbiasedness(results: dict[str, Any]) -> dict[str, float]:
    """Largest |mean − exact| / SE over every point and transform (≈ N(0,1) draws if unbiased)."""
    worst = {}
    for sweep in ("by_theta", "by_k"):
        r = results[sweep]
        for name in TRANSFORMS:
            means, ses = np.array(r[name]["mean"]), np.array(r[name]["mean_se"])
            exact = np.array(r["exact_gradient"])
            if sweep == "by_k":
                exact = exact[[r["k"].index(k) for k in r[name]["k"]]]
            z = np.abs(means - exact) / np.maximum(ses, 1e-12)
            worst[f"{sweep}/{name}"] = float(z.max())
    return worst


def plot(results: dict[str, Any], path: Path) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    r = results["by_theta"]
    for name in TRANSFORMS:
        axes[0].semilogy(r["theta"], r[name]["variance"], label=name)
    axes[0].set(xlabel="θ", ylabel="gradient variance",
                title=f"n={results['config']['n']}, k={r['k']}")
    r = results["by_k"]
    for name in TRANSFORMS:
        axes[1].semilogy(r[name]["k"], r[name]["variance"], "o-", label=name)
    axes[1].set(xlabel="k", ylabel="gradient variance",
                title=f"n={results['config']['n']}, θ={r['theta']}")
    axes[1].set_xscale("log", base=2)
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"PKPO 1-D toy: x ~ N(θ, {results['config']['sigma']:g}²), g(x) = x² on [0, 1]")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], "runs/experiments/pkpo_variance")
    config = yaml.safe_load(CONFIG.read_text())["smoke" if args.smoke else "full"]
    t0 = time.perf_counter()
    results = run(config, seed=config["seed"])
    results["max_abs_z_vs_exact"] = unbiasedness(results)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    common.write_results(args.out, "results", results)
    redraw.draw("pkpo_variance", results, args.out / "pkpo_variance.png", args.results_dir, plot)
    print(f"wrote {args.out / 'results.json'} and pkpo_variance.png in {results['seconds']} s")


if __name__ == "__main__":
    main()
