"""The two sides of the pipeline through storage (`online.exchange`, docs/online.md §
Pipeline): `jaxrl-llm online --role trainer` and `--role worker --worker K` are separate
processes (or hosts) that share only the exchange directory (online/exchange.py).

- The trainer (one or more hosts; process 0 alone writes) runs the in-memory pipeline's
  trainer loop (`pipeline.train_rounds`, `free.free_rounds`) with storage in place of the
  sampler thread: it publishes θ_v as a blob once a round samples with it, reads round r's
  shard in round order (waiting up to `online.worker_timeout_s`), records its progress in
  `trainer.json` after each round and, after a checkpoint at round R, deletes the shards of
  rounds < R and the versions no round ≥ R samples with.
- Worker K runs the in-memory pipeline's sampler side (`sampler_side.SamplerSide`) on its own
  devices for the rounds r ≡ K (mod `online.workers`) that have no shard yet and that the
  trainer's checkpoint has not passed: deterministic, with θ_U(r) (waiting for it), so its
  shard is the serial loop's round; free, with the newest version, at most a bounded number
  of rounds ahead of the trainer.

A SIGKILL of either side loses only work that is redone identically on restart: a shard or
a version appears whole or not at all, rounds are consumed in order from the trainer's last
checkpoint, and a round's samples depend only on its index and its version.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_llm.api import load_policy
from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.core.progress import progress_bar
from jaxrl_llm.online import run_state
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.exchange import Exchange, ExchangeError
from jaxrl_llm.online.free import NO_END, free_counts, free_rounds, rounds_ahead
from jaxrl_llm.online.lag import total_rounds, version_of
from jaxrl_llm.online.pipeline import Opened, open_run, problems_of, train_rounds
from jaxrl_llm.online.placement import Placement, check_placement
from jaxrl_llm.online.rounds import sampling_seed
from jaxrl_llm.online.run_identity import check_file_run, check_manifest, manifest_of
from jaxrl_llm.online.sampler_shape import fixed_sampler_batch
from jaxrl_llm.online.sampler_side import Sampled, SamplerSide, sampler_mu
from jaxrl_llm.online.weight_parts import expected_leaves, local_part
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.sampling.layout import cast_for_sampling, sampling_dtype


def check_roles(config: OnlineConfig, role: str | None, worker: int | None) -> None:
    """The CLI's --role / --worker against `online.exchange` and `online.workers`."""
    o = config.online
    if o.exchange and role is None:
        raise ConfigError(f"online.exchange={o.exchange} runs one side of a storage pipeline: "
                          "add --role trainer (one job) or --role worker --worker K (K = 0 … "
                          f"{o.workers - 1}), or unset online.exchange for one process")
    if role is not None and not o.exchange:
        raise ConfigError(f"--role {role} needs online.exchange (the directory the trainer and "
                          "the workers share, local or gs://): set it, or drop --role")
    if role == "worker" and (worker is None or not 0 <= worker < o.workers):
        raise ConfigError(f"--role worker needs --worker K with 0 <= K < online.workers="
                          f"{o.workers} (got {worker})")
    if role == "trainer" and worker is not None:
        raise ConfigError("--worker K is for --role worker; the trainer takes every worker's "
                          "rounds")


def _lead() -> bool:
    return jax.process_index() == 0


def _shared_token() -> str:
    """A random token every process of the job agrees on (process 0's)."""
    token = np.frombuffer(secrets.token_bytes(8), np.uint8)
    if jax.process_count() > 1:
        token = np.asarray(multihost_utils.broadcast_one_to_all(token))
    return bytes(token.astype(np.uint8)).hex()


@dataclass
class StorageTrainer(Opened):
    """`pipeline.Opened` whose sampler side is the exchange."""

    ex: Any = None
    manifest: Any = None  # run_identity.manifest_of: what names this run
    dtype: Any = None  # the sampling dtype versions are published in
    incarnation: str = ""
    saved_round: int = 0  # the round (free: sampled rounds) of the newest checkpoint
    restored_updates: int = 0
    feed: Any = None

    def publish(self) -> float:
        """This process's part of θ_updates (weight_parts.py: the shards it holds, in the
        sampling dtype; no process gathers the model; deterministic: once, its bytes cannot
        change); the trainer's pause in seconds."""
        t0 = time.perf_counter()
        v, part, parts = self.run.updates, jax.process_index(), jax.process_count()
        path = self.ex.part_path(v, part, parts)
        if self.config.online.pipeline == "deterministic":
            head = self.ex.part_header(path)
            if head:  # a part left before a kill is kept, when this run wrote it
                check_file_run(path, "weight part", head.get("identity", {}).get("run"),
                               self.manifest)
                return time.perf_counter() - t0
        state = self.policy.state
        leaves, payload = local_part(cast_for_sampling((state.params, state.model_state),
                                                       self.dtype))
        self.ex.publish_part(v, part, parts, leaves, payload,
                             {"run": self.manifest["run_id"], "model": self.manifest["model"],
                              "incarnation": self.incarnation})
        return time.perf_counter() - t0

    def save(self, pending: list[Any], **extra: Any) -> None:
        super().save(pending, **extra)
        self.saved_round = int(extra.get("sampled_rounds", self.run.round))

    def round_done(self, saved: bool) -> None:
        if not _lead():
            return
        self.write_progress(done=False)
        if not saved:
            return
        if self.config.online.pipeline == "free":  # workers take the newest: keep two
            self.ex.collect(versions_below=self.run.updates - 1, rounds_below=self.saved_round)
        else:
            self.ex.collect(versions_below=version_of(self.config, self.saved_round),
                            rounds_below=self.saved_round)

    def write_progress(self, *, done: bool) -> None:
        consumed = self.feed.next if self.feed is not None else self.saved_round
        self.ex.write_json("trainer.json", {
            "round": self.saved_round, "consumed": consumed, "updates": self.run.updates,
            "done": done, "incarnation": self.incarnation})


class StoredFeed:
    """The trainer's rounds from the exchange, in order (`sampler_side.Feed`'s interface)."""

    def __init__(self, opened: StorageTrainer, first: int) -> None:
        self.opened, self.next, self.waited = opened, first, 0.0
        opened.feed = self

    def get(self) -> Sampled:
        t0 = time.perf_counter()
        o, ex, r = self.opened.config.online, self.opened.ex, self.next
        worker = r % o.workers
        ex.wait(ex.round_path(r).exists, f"record shard of round {r} (worker {worker})",
                f"`jaxrl-llm online --role worker --worker {worker}`")
        header, batches = ex.get_round(r, self.opened.config.model.vocab_size)
        check_file_run(ex.round_path(r), "record shard", header.get("run"),
                       self.opened.manifest)
        version = self._checked(r, int(header["version"]), header.get("incarnation"))
        self.waited += time.perf_counter() - t0
        self.next = r + 1
        if o.pipeline == "free" and _lead():  # free workers sample a bounded way ahead of it
            self.opened.write_progress(done=False)
        return Sampled(r, version, int(header["position"]), batches,
                       {**header["metrics"], "pipeline/worker": float(worker)},
                       header["mu_source"], header["seconds"])

    def _checked(self, r: int, version: int, incarnation: str | None) -> int | None:
        opened, o = self.opened, self.opened.config.online
        path = opened.ex.round_path(r)
        if o.pipeline == "deterministic":
            want = version_of(opened.config, r)
            if version != want:
                raise ExchangeError(
                    f"{path}: round {r} was sampled with θ_{version}, outside the bound: "
                    f"online.staleness={o.staleness} samples it with θ_{want}. Another run or "
                    f"config wrote it; delete it (worker {r % o.workers} samples it again)")
            return version
        if incarnation != self.opened.incarnation and version > opened.restored_updates:
            return None  # weights a killed trainer published past its checkpoint: lost
        if not 0 <= version <= opened.run.updates:
            raise ExchangeError(
                f"{path}: round {r} was sampled with θ_{version}, outside the bound 0 … "
                f"θ_{opened.run.updates} the trainer has published: another run wrote it; "
                f"delete it, or give this run an empty online.exchange")
        return version

    def close(self) -> None:
        pass


def run_trainer(config: OnlineConfig, *, progress: bool = True, eval_hook: Any = None,
                eval_every: int = 0, eval_at_start: bool = False) -> Any:
    """The trainer side (module docstring); `run_state.OnlineResult`."""
    o = config.online
    check_roles(config, "trainer", None)
    opened = open_run(config, sampler=False, opened=StorageTrainer)
    assert isinstance(opened, StorageTrainer)
    ex = opened.ex = Exchange(o.exchange, o.worker_timeout_s)
    ours = opened.manifest = manifest_of(config, opened.policy.tokenizer)
    theirs = ex.read_json("manifest.json")
    if theirs is not None:
        check_manifest(ex.root / "manifest.json", ours, theirs, "trainer")
    elif _lead():
        ex.write_json("manifest.json", ours)
    opened.dtype = sampling_dtype(opened.policy.model)
    opened.incarnation = _shared_token()  # one for the whole (multi-host) trainer
    opened.restored_updates = opened.run.updates
    free = o.pipeline == "free"
    counts = free_counts(opened.meta)
    opened.saved_round = counts["sampled_rounds"] if free else opened.run.round
    if _lead():
        opened.write_progress(done=False)
        if free:  # workers must not take the newest of versions lost with a killed trainer
            ex.collect(versions_below=0, rounds_below=0, versions_above=opened.run.updates)
    if free:
        result = free_rounds(opened, lambda: StoredFeed(opened, counts["sampled_rounds"]),
                             progress=progress, eval_hook=eval_hook, eval_every=eval_every,
                             eval_at_start=eval_at_start)
    else:
        result = train_rounds(opened, lambda: StoredFeed(opened, opened.run.round),
                              progress=progress, eval_hook=eval_hook, eval_every=eval_every,
                              eval_at_start=eval_at_start)
    if _lead() and not result.stopped:  # a stopped trainer resumes: its workers wait
        opened.write_progress(done=True)  # free-running workers stop
    return result


class _Skip(Exception):
    """The round no longer needs sampling (the trainer passed it, or finished)."""


class _Newer(Exception):
    """Free-running: the newest version was collected before it was read; take the next."""


class StoredWeights:
    """`sampler_side.Weights` for a worker: versions read from the exchange, assembled from every
    trainer process's part, straight into the worker's decode layout (`shardings`)."""

    def __init__(self, ex: Exchange, template: Any, shardings: Any,
                 manifest: dict[str, Any], dtype: Any) -> None:
        self.ex, self.manifest, self.round = ex, manifest, 0
        self._expected = expected_leaves(template, dtype)
        self._tree = jax.tree_util.tree_structure(template)
        self._shardings = shardings
        self._cached: tuple[int, Any] | None = None
        self._cached_sha: str | None = None
        self.incarnation: str | None = None
        self.free = False

    def _passed(self) -> bool:
        progress = self.ex.progress()
        return bool(progress["done"]) or self.round < int(progress["round"])

    def newest(self) -> int:
        found = self.ex.wait(lambda: self.ex.versions(), "weight version",
                             "`jaxrl-llm online --role trainer`", give_up=self._passed)
        if found is None:
            raise _Skip
        return found[-1]

    def take_newest(self, after: int | None = None) -> tuple[int, Any] | None:
        """`sampler_side.Weights.take_newest`: the newest version on file and its weights."""
        version = self.newest()
        if after is not None and version <= after:
            return None
        return version, self.take(version)

    def take(self, version: int) -> Any:
        if self._cached is not None and self._cached[0] == version:
            if not self.free:  # deterministic: θ_v's bytes cannot change
                return self._cached[1]
            # free: a restarted trainer publishes its own θ_v over a killed one's, so the
            # number alone does not name the weights: the payload's SHA-256 does. Same bytes:
            # the rounds are stamped with the publisher now on file (stamped with a killed
            # trainer's, the restarted one drops every round as sampled by lost weights)
            head = self.ex.header(version)
            if head is None:
                raise _Newer
            if head.get("sha256") == self._cached_sha:
                self.incarnation = head.get("identity", {}).get("incarnation")
                return self._cached[1]
        ready = lambda: self.ex.parts_of(version)
        if self.free and not ready():
            raise _Newer
        if self.ex.wait(ready, f"weight version θ_{version}",
                        "`jaxrl-llm online --role trainer`", give_up=self._passed) is None:
            raise _Skip
        try:
            header, arrays = self.ex.load(version)
        except FileNotFoundError:
            if not self.free:
                raise
            # free: the trainer keeps only its newest versions and deleted this one between
            # the check above and the read (a gs:// read can outlast two updates), or a
            # restarted trainer is overwriting it: the caller takes the newest (`_sample`)
            raise _Newer from None
        where = f"{self.ex.weights}/v{version:08d}-*"
        identity = header.get("identity", {})
        theirs = [tuple(leaf) for leaf in header["leaves"]]
        ours = [tuple(leaf) for leaf in self._expected]
        if identity.get("model") != self.manifest["model"] or ours != theirs:
            bad = next((f"{a} vs the trainer's {b}" for a, b in zip(ours, theirs)
                        if a != b), f"{len(ours)} arrays vs the trainer's {len(theirs)}")
            raise ExchangeError(
                f"{where}: θ_{version} does not fit this worker's model (first difference: "
                f"{bad}): run both sides with the same model: section")
        check_file_run(where, "weight version", identity.get("run"), self.manifest)
        placed = jax.block_until_ready(jax.device_put(
            jax.tree_util.tree_unflatten(self._tree, arrays), self._shardings))
        self.incarnation = identity.get("incarnation")
        self._cached, self._cached_sha = (version, placed), header.get("sha256")
        return placed

    def close(self) -> None:
        pass


def run_worker(config: OnlineConfig, index: int, *, progress: bool = True) -> dict[str, Any]:
    """Worker `index` (module docstring) until its last round, or the trainer's end (free);
    a summary of what it sampled."""
    o, g = config.online, config.generate
    check_roles(config, "worker", index)
    run_state.check_config(config)
    if g.backend == "vllm":
        from jaxrl_llm.online.vllm_rollout import check_vllm_worker

        check_vllm_worker(config)
    check_placement(config, jax.devices())
    ex = Exchange(o.exchange, o.worker_timeout_s)
    mesh = make_mesh(config.mesh, jax.devices())
    policy = load_policy(config=run_state.experiment_of(config), mesh=mesh)
    ours = manifest_of(config, policy.tokenizer)
    theirs = ex.wait(lambda: ex.read_json("manifest.json"), "manifest.json",
                     "`jaxrl-llm online --role trainer`")
    check_manifest(ex.root / "manifest.json", ours, theirs, "worker")
    problems = problems_of(config, policy)
    placement = Placement(mesh, mesh)
    # versions go straight into the decode layout the sampler decodes with: no second copy
    layout = placement.sampler_layout(policy.model.config.num_kv_heads, data=g.decode_data,
                                      tensor=g.decode_tensor)
    template = (policy.state.params, policy.state.model_state)
    weights = StoredWeights(ex, template, layout.weight_shardings(template), ours,
                            sampling_dtype(policy.model))
    side = SamplerSide(config, policy, placement, problems, weights, mu_source=None,
                       mu=sampler_mu(config))
    del policy, template  # the side keeps its own Policy (no optimizer state)
    side.policy.sampler_batch = _sampler_batch(ex, config, side, problems)
    engine = f"jax {jax.__version__}"
    if g.backend == "vllm":  # vLLM samples; the JAX policy takes the versions and scores μ
        from jaxrl_llm.online.vllm_rollout import VllmRollout

        side.sampler = VllmRollout(side.policy, problems)
        engine = side.sampler.engine_name
    free = o.pipeline == "free"
    last = NO_END if free else total_rounds(config)
    side.free = weights.free = free
    side.bar = progress_bar(None if free else len(range(index, last, o.workers)),
                            desc=f"worker {index}", unit="round", enabled=progress)
    sampled = skipped = 0
    try:
        for r in range(index, last, o.workers):
            state = ex.progress()
            if state["done"]:
                break
            if r < int(state["round"]) or ex.round_path(r).exists():
                skipped += 1  # the trainer has it, or a run before a kill sampled it
                side.bar.update(1)
                continue
            weights.round = r
            if free and ex.wait(lambda r=r: r < int(ex.progress()["consumed"])
                                + max(rounds_ahead(config), o.workers), f"the trainer to "
                                f"consume round {r - rounds_ahead(config)}", "the trainer",
                                give_up=weights._passed) is None:
                break
            _decided_mu(ex, side, r)
            try:
                done = _sample(side, r, r * o.prompts_per_round % len(problems))
            except _Skip:
                continue
            if r == 0:  # the μ decision every later round keeps (online.mu_source: auto)
                ex.write_json("mu_source.json", {"mu_source": done.mu_source})
            ex.put_round(r, {"run": ours["run_id"], "version": done.version,
                             "position": done.position,
                             "metrics": done.metrics, "mu_source": done.mu_source,
                             "seconds": done.seconds, "worker": index,
                             "incarnation": weights.incarnation,
                             "sampler": {"backend": g.backend, "engine": engine,
                                         "seed": sampling_seed(config.seed, r),
                                         "temperature": g.temperature,
                                         "top_k": g.top_k, "top_p": g.top_p}},
                         done.batches)
            sampled += 1
    finally:
        side.bar.close()
        if g.backend == "vllm":
            side.sampler.close()
    return {"worker": index, "sampled_rounds": sampled, "skipped_rounds": skipped,
            "engine": engine, "exchange": str(ex.root)}


def _sampler_batch(ex: Exchange, config: OnlineConfig, side: SamplerSide,
                   problems: list[Any]) -> int:
    """Every worker's prompt batch for the whole run (`online/sampler_shape.py`): the first
    worker to start decides it (beside the version it caches, one more in flight) and
    records it in `sampler.json`; the others, and restarts, take it from there."""
    decided = ex.read_json("sampler.json")
    if decided is None:
        ex.write_json("sampler.json", {"sampler_batch": fixed_sampler_batch(
            config, side.policy, problems, in_flight=1)})
        decided = ex.read_json("sampler.json")  # two first workers: the last write wins
    return int(decided["sampler_batch"])


def _sample(side: SamplerSide, r: int, position: int) -> Sampled:
    while True:
        try:
            return side.sample(r, position)
        except _Newer:
            continue


def _decided_mu(ex: Exchange, side: SamplerSide, r: int) -> None:
    """A worker's first round after 0 takes round 0's μ decision (auto decides it there)."""
    o = side.config.online
    if r == 0 or side.mu_source is not None or o.mu_source != "auto":
        return
    if not (side.config.loss.spec.needs_mu and run_state.untruncated(side.config)):
        return  # no μ, or auto's answer is "trainer" without a look at round 0
    decided = ex.wait(lambda: ex.read_json("mu_source.json"), "mu_source.json (round 0's μ "
                      "decision)", "`jaxrl-llm online --role worker --worker 0`")
    side.mu_source = decided["mu_source"]
