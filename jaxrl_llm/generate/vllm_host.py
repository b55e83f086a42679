"""The vLLM side of an `iterate` run: sample iteration i from π_{i−1} with one long-lived engine.

`serve_iterations` (`jaxrl-llm vllm host --config C`) walks the iterations in order. For
each whose records are not complete it waits until π_{i−1}'s export is on the run directory
(`run_layout.policy_ready`), loads it into the engine — started once, then `reload`ed in
place — and writes `iter_i/records` (resumable, `data/chunked.py`). The trainer side
(`iterate` with `generate.backend: vllm`) waits for those records. The two share nothing but
the run directory, so they run as two processes on one host (`iterate.vllm_host: local`:
`iterate` starts this loop itself, `LocalHost`) or on different hosts (`external`), and
either can be killed and restarted with the same command: completed records are skipped,
a partial chunk is redone, a missing export is waited for.

A lock file (`run_dir/vllm_host.lock`, `fcntl.flock`) keeps a second host from writing the
same run's records.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.core.signals import stop_point
from jaxrl_llm.data.chunked import complete
from jaxrl_llm.data.run_layout import (
    iteration_dir,
    policy_dir,
    policy_ready,
    prompt_offset,
    sampling_seed,
)
from jaxrl_llm.generate.completions import encode_prompts, format_prompts
from jaxrl_llm.generate.vllm import (
    VllmEngine,
    engine_settings,
    generate_vllm_records,
    needed_model_len,
)
from jaxrl_llm.generate.vllm_env import require_vllm
from jaxrl_llm.tasks import task_from_config

LOCK_NAME = "vllm_host.lock"
LOG_NAME = "vllm_host.log"


class HostError(ConfigError):
    """The vLLM host cannot serve the run (another host holds it), stopped, or did not
    deliver records in time; the CLI prints the message and exits 2, no traceback."""


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"[vllm host] {text}", flush=True)


@contextlib.contextmanager
def host_lock(run_dir: str) -> Iterator[None]:
    """Hold `run_dir/vllm_host.lock` for the life of the loop; a second host fails fast."""
    path = Path(run_dir) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            f.seek(0)
            raise HostError(f"another vLLM host holds {path} (pid {f.read().strip() or '?'}); "
                            "one host serves a run") from err
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield


def wait_for(ready: Any, what: str, *, poll_seconds: float, timeout: float | None,
             progress: bool, alive: Any = None) -> None:
    """Poll `ready()` until true; `alive()` false (the other side died) or the timeout is an
    error naming `what`."""
    start = last_note = time.monotonic()
    while not ready():
        if alive is not None:
            alive()
        now = time.monotonic()
        if timeout is not None and now - start > timeout:
            raise HostError(f"gave up waiting {timeout:.0f} s for {what}")
        if now - last_note > 60:
            _say(progress, f"still waiting for {what} ({now - start:.0f} s)")
            last_note = now
        time.sleep(poll_seconds)


def serve_iterations(config: Any, *, poll_seconds: float = 2.0, timeout: float | None = None,
                     progress: bool = True) -> None:
    """Write every iteration's records of an iterate `config` with vLLM (see the module
    docstring). Returns when the last iteration's records are complete."""
    from transformers import AutoTokenizer

    g, d, iterations = config.generate, config.data, config.iterate.iterations
    install = require_vllm()
    task = task_from_config(config)
    total = prompt_offset(config, iterations) + d.num_prompts
    problems = task.load(split=g.split, num=total, seed=config.seed)
    engine: VllmEngine | None = None
    # SIGTERM (iterate stopping its local host, or dying) or Ctrl-C stops between chunks and
    # polls, and the engine is closed, so its processes stop too.
    with host_lock(config.run_dir), stop_point("the current chunk, closing the engine") as stop:
        try:
            for index in range(1, iterations + 1):
                records = iteration_dir(config, index) / "records"
                if complete(records) is not None:
                    continue
                wait_for(lambda i=index: policy_ready(config, i - 1), f"π_{index - 1} "
                         f"({policy_dir(config, index - 1)})", poll_seconds=poll_seconds,
                         timeout=timeout, progress=progress,
                         alive=lambda: stop.check("vllm host", "iterate starts it again"))
                model = policy_dir(config, index - 1)
                t0 = time.perf_counter()
                if engine is None:
                    # Size the engine once for every iteration's prompts.
                    tokenizer = AutoTokenizer.from_pretrained(model)
                    texts = format_prompts(tokenizer, [task.prompt(p) for p in problems],
                                           chat_template=d.chat_template)
                    all_ids = encode_prompts(tokenizer, texts, chat_template=d.chat_template)
                    max_len = needed_model_len(all_ids, g.max_new_tokens, g.vllm_max_model_len)
                    engine = VllmEngine(engine_settings(config, model, max_model_len=max_len,
                                                        on_cpu=install.on_cpu))
                    _say(progress, f"engine started on {model} ({install}, "
                                   f"{time.perf_counter() - t0:.1f} s)")
                elif engine.model != model:
                    engine.reload(model)
                    _say(progress, f"reloaded weights in place from {model} "
                                   f"({time.perf_counter() - t0:.1f} s)")
                offset = prompt_offset(config, index)
                t0 = time.perf_counter()
                manifest = generate_vllm_records(
                    config, model, str(records), engine=engine,
                    problems=problems[offset:offset + d.num_prompts], prompt_offset=offset,
                    seed=sampling_seed(config, index), progress=progress)
                _say(progress, f"iteration {index}: wrote {manifest.num_records} records "
                               f"({time.perf_counter() - t0:.1f} s)")
        finally:
            if engine is not None:
                engine.close()


PARENT_ENV = "JAXRL_VLLM_HOST_PARENT"


def die_with_parent() -> None:
    """In a host started by `LocalHost`: get SIGTERM when the parent `iterate` dies (Linux
    prctl PR_SET_PDEATHSIG), so a killed trainer does not leave an engine running; exit at
    once if it is already gone."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != int(parent):
        sys.exit(143)


class LocalHost:
    """`jaxrl-llm vllm host` as a child process of `iterate` (`iterate.vllm_host: local`),
    its output in `run_dir/vllm_host.log`."""

    def __init__(self, config_file: str, run_dir: str) -> None:
        self.log_path = Path(run_dir) / LOG_NAME
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "jaxrl_llm.cli", "vllm", "host", "--config", config_file]
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env)

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None and code != 0:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-8:]
            raise HostError(f"the vLLM host exited with code {code}; last lines of "
                            f"{self.log_path}:\n" + "\n".join(tail))

    def stop(self, grace: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
