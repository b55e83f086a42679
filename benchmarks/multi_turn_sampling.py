"""Multi-turn episodes against single-turn samples in the continuous sampler, at equal tokens:
does the sampler stall on the environment?

A random decoder (float32, `--vocab` ids; random weights give a near-uniform next-token
distribution, so a turn's end is made by a stop set, as in benchmarks/gpu_sampler.py: vocab /
m ids, a turn ends at each step with probability ≈ 1 / m). Every sequence has the same budget
of L = `--new` completion positions:

- single: one sample per sequence, no stop: exactly L tokens each;
- multi (m, latency): an episode per sequence. A model turn ends at a stop-set token; the
  environment (a `sampling.turns.TurnHook` on a host thread pool, one worker per slot, so no
  call queues for a worker) sleeps `latency`, then answers an observation of o = `--obs`
  fixed token ids, fed into the slot's cache while the other slots decode; the episode goes on
  until its budget is spent (the last turn runs out of tokens), or ends where an observation
  would leave no room for a model token. So K ≈ L / (m + o) turns per episode, and every
  episode holds about L tokens, as the single-turn sample does: the same decode work (a fed
  token takes one decode step, as a sampled one).

Sampled tokens do not depend on timing or slot placement (each token's noise is keyed by the
sample and position alone), so every multi-turn arm of one m decodes exactly the same episodes
whatever the latency. Tokens/s counts every completion position (model and environment tokens:
each is one slot's decode step); model tokens/s is given beside it. Each arm is warmed up (the
programs compiled) once, then the arms run round-robin `--runs` times; medians.

Idle slots: the decode program's segments are observed (a wrapper around `decode_slots` that
reads each slot's position before and after: within a segment a running slot runs from its
first step until it stops, and no slot starts, so the running count at each step follows).
Per arm: the share of decode steps with an idle slot (one parked for its environment, one
waiting to be handed to it or refilled, or the tail), and the share of slot-steps idle.

    nice -n 10 python benchmarks/multi_turn_sampling.py --runs 3  # the run in docs/benchmarks.md
    python benchmarks/multi_turn_sampling.py --smoke --out s.json  # tiny sizes (the check)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from flax import nnx
from machine import cpu_name  # benchmarks/, this script's directory

from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.sampling import continuous
from jaxrl_llm.sampling.continuous import ContinuousSampler
from jaxrl_llm.sampling.sampler import SamplingParams

RESULTS = Path(__file__).parent / "results"
PAD = 0  # never a stop id nor an observation id


class FixedObservations:
    """A `TurnHook`: after each model turn, `latency_s` on a worker thread, then `obs` (the
    same ids every time), or None once the episode's budget has no room for it."""

    def __init__(self, stop_ids: tuple[int, ...], obs: list[int], latency_s: float,
                 budget: int, workers: int):
        self.stop_ids, self.obs, self.latency_s, self.budget = stop_ids, obs, latency_s, budget
        self.pool = ThreadPoolExecutor(workers)
        self.used: dict[int, int] = {}  # row → completion positions so far
        self.turns: dict[int, int] = {}  # row → model turns
        self.fed: dict[int, list[int]] = {}  # row → the positions each observation starts at

    def submit(self, row: int, tokens: np.ndarray, logprobs: np.ndarray, stopped: bool
               ) -> Future:
        # the bookkeeping on the sampler's thread (calls for one row never overlap)
        used = self.used.get(row, 0) + len(tokens)
        self.turns[row] = self.turns.get(row, 0) + 1
        fits = stopped and used + len(self.obs) < self.budget  # room left for a model token
        if fits:
            self.fed.setdefault(row, []).append(used)
        self.used[row] = used + (len(self.obs) if fits else 0)
        answer = list(self.obs) if fits else None
        if self.latency_s == 0:
            return self.pool.submit(lambda: answer)
        return self.pool.submit(lambda: (time.sleep(self.latency_s), answer)[1])

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class SegmentLog:
    """Observes `continuous.decode_slots`: the running slots at each decode step."""

    def __init__(self):
        self.steps_with_idle = self.steps = self.idle_slot_steps = self.slot_steps = 0
        self.segments = 0
        self._inner = continuous.decode_slots

    def __call__(self, graphdef, state, layer_params, carry, store, *args, **kwargs):
        before = np.asarray(carry["state"]["t"]).copy()
        active = np.asarray(carry["state"]["active"]).copy()
        carry = self._inner(graphdef, state, layer_params, carry, store, *args, **kwargs)
        ran = (np.asarray(carry["state"]["t"]) - before)[active]  # steps each running slot ran
        done = int(carry["steps"])
        running = (ran[None, :] > np.arange(done)[:, None]).sum(1)  # per step
        rows = len(before)
        self.segments += 1
        self.steps += done
        self.steps_with_idle += int((running < rows).sum())
        self.slot_steps += rows * done
        self.idle_slot_steps += int((rows - running).sum())
        return carry


def build_model(args) -> Decoder:
    config = DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                           intermediate_size=4 * args.hidden, num_layers=args.layers,
                           num_heads=args.hidden // 64 or 1, num_kv_heads=max(1, args.hidden // 128),
                           max_position_embeddings=1024)
    return Decoder(config, rngs=nnx.Rngs(0))


def stop_set(vocab: int, mean: int) -> tuple[int, ...]:
    """vocab / mean distinct ids, never PAD nor an observation id (the top of the vocabulary)."""
    ids = np.random.default_rng(1).choice(np.arange(1, vocab - 64), size=vocab // mean,
                                          replace=False)
    return tuple(int(i) for i in np.sort(ids))


def arm_names(args) -> list[tuple[str, int | None, float, bool]]:
    """(name, mean turn tokens m or None: single-turn, latency in seconds, quick hand-off)."""
    arms = [("single", None, 0.0, False)]
    for m in args.turn_tokens:
        arms += [(f"multi_m{m}_lat{lat:g}ms", m, lat / 1e3, False) for lat in args.latency_ms]
    if args.handoff_turn_tokens:
        arms.append(("single_handoff", None, 0.0, True))
    for m in args.handoff_turn_tokens:
        arms += [(f"multi_m{m}_lat{lat:g}ms_handoff", m, lat / 1e3, True)
                 for lat in args.latency_ms]
    return arms


def summarize(meta: dict, raw: dict[str, list[dict]]) -> list[dict]:
    """One row per arm: medians over its runs, ratios to single-turn of the same hand-off."""
    arms = [tuple(a) for a in meta["arms"]]
    median = lambda runs, f: statistics.median(f(r) for r in runs)
    single = {handoff: raw[name] for name, m, _, handoff in arms if m is None}
    single_rate = {h: median(runs, lambda r: r["tokens"] / r["seconds"])
                   for h, runs in single.items()}
    single_per_step = {h: runs[0]["tokens"] / median(runs, lambda r: r["steps"])
                       for h, runs in single.items()}
    rows = []
    for name, m, latency, handoff in arms:
        runs = raw[name]
        if len({r["tokens"] for r in runs}) != 1 or len(
                {r.get("lengths_digest") for r in runs}) != 1:
            raise AssertionError(f"{name}: the runs decoded different episodes")
        rate = median(runs, lambda r: r["tokens"] / r["seconds"])
        first = runs[0]
        steps = median(runs, lambda r: r["steps"])
        rows.append(dict(
            arm=name, mean_turn_tokens=m, latency_ms=latency * 1e3, handoff=handoff,
            sequences=meta["prompts"] * meta["n"], tokens=first["tokens"],
            model_tokens=first["model_tokens"],
            turns_per_episode=first.get("turns_per_episode", 1.0),
            tokens_per_s=rate,
            model_tokens_per_s=median(runs, lambda r: r["model_tokens"] / r["seconds"]),
            over_single=rate / single_rate[handoff],
            seconds_median=median(runs, lambda r: r["seconds"]),
            decode_steps=steps, segments=median(runs, lambda r: r["segments"]),
            # tokens per decode step: what the schedule gives, whatever the machine's load
            tokens_per_step=first["tokens"] / steps,
            per_step_over_single=first["tokens"] / steps / single_per_step[handoff],
            ms_per_step=median(runs, lambda r: 1e3 * r["seconds"] / max(1, r["steps"])),
            steps_with_idle_share=median(runs, lambda r: r["steps_with_idle"] / max(1, r["steps"])),
            idle_slot_share=median(runs, lambda r: r["idle_slot_steps"] / max(1, r["slot_steps"]))))
    return rows


def write_outputs(out: Path, meta: dict, raw: dict[str, list[dict]]) -> None:
    """out (.json: meta, rows, raw runs) and its .md table."""
    rows = summarize(meta, raw)
    for row in rows:
        print(json.dumps(row), flush=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows, raw=raw), indent=2) + "\n")
    lines = ["| arm | hand-off | m | latency (ms) | turns / episode | tokens (model) | tok/s | "
             "÷ single | tokens / step (÷ single) | segments | ms / step | steps with an idle "
             "slot | idle slot-steps |",
             "| --- | --- |" + " ---: |" * 11]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {'quick' if r['handoff'] else 'default'} | "
            f"{r['mean_turn_tokens'] or '–'} | {r['latency_ms']:g} | "
            f"{r['turns_per_episode']:.2f} | {r['tokens']} ({r['model_tokens']}) | "
            f"{r['tokens_per_s']:.0f} | {r['over_single']:.2f}× | {r['tokens_per_step']:.1f} "
            f"({r['per_step_over_single']:.2f}×) | {r['segments']:.0f} | {r['ms_per_step']:.2f} | "
            f"{r['steps_with_idle_share']:.0%} | {r['idle_slot_share']:.0%} |")
    load_before, load_after = meta["load_average_before"], meta["load_average_after"]
    out.with_suffix(".md").write_text(
        f"{meta['cpu']}, {meta['cores']} cores, {meta['device']}; random decoder (vocab "
        f"{meta['vocab']}, hidden {meta['hidden']}, {meta['layers']} layers), {meta['slots']} "
        f"slots, {meta['prompts']} prompts × n = {meta['n']}, {meta['new']} positions per "
        f"sequence, observations of {meta['obs']} tokens; medians of {meta['runs']} runs; load "
        f"average before {load_before[0]:.1f}, after {load_after[0]:.1f}\n\n"
        + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4, help="samples (episodes) per prompt")
    ap.add_argument("--new", type=int, default=256, help="completion positions per sequence")
    ap.add_argument("--obs", type=int, default=16, help="observation tokens")
    ap.add_argument("--turn-tokens", type=int, nargs="+", default=[112, 48, 16],
                    help="mean model tokens per turn (m); K ≈ new / (m + obs) turns")
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0, 100.0])
    ap.add_argument("--handoff-turn-tokens", type=int, nargs="*", default=[48],
                    help="m of the arms run with a quick hand-off: refill_slots=1, "
                    "segment_steps=8 (a segment ends as soon as one more slot is free, and "
                    "after at most 8 steps once every prompt has a slot)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 run (the check)")
    ap.add_argument("--out", default=str(RESULTS / "multi_turn_sampling.json"))
    ap.add_argument("--reuse", default=None, help="a results file of an earlier run: redo "
                    "its rows and table from its raw runs, run nothing")
    args = ap.parse_args(argv)
    if args.reuse:
        saved = json.loads(Path(args.reuse).read_text())
        meta = saved["meta"]
        if "arms" not in meta:  # files written before the arms were kept in meta
            meta["arms"] = [(r["arm"], r["mean_turn_tokens"], r["latency_ms"] / 1e3,
                             r["handoff"]) for r in saved["rows"]]
        write_outputs(Path(args.out), meta, saved["raw"])
        print(f"wrote {args.out}")
        return 0
    if args.smoke:
        args.slots, args.prompts, args.n, args.new, args.obs = 8, 4, 4, 48, 4
        args.turn_tokens, args.handoff_turn_tokens, args.latency_ms = [8], [8], [0.0, 10.0]
        args.vocab, args.hidden, args.layers, args.runs = 256, 64, 1, 1
    if args.obs < 1 or args.new <= args.obs + 1:
        ap.error(f"--obs {args.obs} must be >= 1 and leave room in --new {args.new}")

    model = build_model(args)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, args.vocab - 64, int(rng.integers(16, 49))).tolist()
               for _ in range(args.prompts)]
    obs = list(range(args.vocab - args.obs, args.vocab))  # ids never in a stop set
    log = SegmentLog()
    continuous.decode_slots = log  # the sampler's module global: every segment observed
    samplers = {handoff: ContinuousSampler(model, slots=args.slots, pad_token_id=PAD,
                                           prefill_chunk=64,
                                           **(dict(refill_slots=1, segment_steps=8)
                                              if handoff else {}))
                for handoff in (False, True)}
    arms = arm_names(args)

    def run(name: str, m: int | None, latency: float, handoff: bool) -> dict:
        params = SamplingParams(max_new_tokens=args.new, temperature=1.0, n=args.n)
        hook = (None if m is None else
                FixedObservations(stop_set(args.vocab, m), obs, latency, args.new, args.slots))
        before = {k: getattr(log, k) for k in ("steps", "steps_with_idle", "slot_steps",
                                               "idle_slot_steps", "segments")}
        start = time.perf_counter()
        out = samplers[handoff].generate(prompts, params, jax.random.key(0), turns=hook)
        seconds = time.perf_counter() - start
        lengths = np.asarray(out.lengths, np.int64)
        row = dict(seconds=seconds, tokens=int(lengths.sum()),
                   **{k: getattr(log, k) - v for k, v in before.items()})
        if hook is None:
            row["model_tokens"] = row["tokens"]
            return row
        hook.close()
        mask = np.asarray(out.action_mask)
        tokens = np.asarray(out.tokens)
        for r, length in enumerate(lengths):  # the fed positions are the hook's observations
            fed = np.zeros(args.new, bool)
            for at in hook.fed.get(r, []):
                fed[at:at + len(obs)] = True
                if tokens[r, at:at + len(obs)].tolist() != obs:
                    raise AssertionError(f"{name}: row {r}: observation at {at} not fed as given")
            if not np.array_equal(mask[r, :length] == 0, fed[:length]):
                raise AssertionError(f"{name}: row {r}: action mask differs from the feeds")
        row.update(model_tokens=int(sum(mask[r, :n].sum() for r, n in enumerate(lengths))),
                   turns_per_episode=float(np.mean([hook.turns.get(r, 1)
                                                    for r in range(len(lengths))])),
                   lengths_digest=int(lengths @ np.arange(1, len(lengths) + 1)))
        return row

    load_before = os.getloadavg()
    for arm in arms:  # warm-up: every program each arm's schedule needs, compiled
        run(*arm)
        print(f"warmed {arm[0]}", file=sys.stderr, flush=True)
    raw: dict[str, list[dict]] = {name: [] for name, *_ in arms}
    for _ in range(args.runs):
        for arm in arms:
            raw[arm[0]].append(run(*arm))
    load_after = os.getloadavg()

    meta = dict(cpu=cpu_name(), cores=len(os.sched_getaffinity(0)), jax=jax.__version__,
                device=jax.devices()[0].device_kind, slots=args.slots, prompts=args.prompts,
                n=args.n, new=args.new, obs=args.obs, vocab=args.vocab, hidden=args.hidden,
                layers=args.layers, runs=args.runs, load_average_before=load_before,
                load_average_after=load_after, argv=sys.argv[1:] if argv is None else argv,
                arms=arms)
    write_outputs(Path(args.out), meta, raw)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
