"""The pipeline's launch layouts (launch/tpu_pipeline.sh, launch/slurm_pipeline.sbatch): the
commands each prints with --dry-run, parsed back — every rollout worker id exactly once on
its own host, the trainer on every trainer host with one jax.distributed coordinator, the
same exchange directory and config on both sides — and, with stand-ins for gcloud / srun
(neither runs here), that the real path starts those same commands and stops the rest when
one side fails."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_llm.cli import build_parser
from jaxrl_llm.config import load_config
from jaxrl_llm.online.config import OnlineConfig, OnlineSection

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/online_pipeline_pod.yaml"
SCRIPTS = ("launch/tpu_pipeline.sh", "launch/slurm_pipeline.sbatch", "launch/sides.sh")
VENV = Path(sys.executable).parents[1]  # the venv running the tests (its bin/activate)


def _run(args: list[str], tmp_path: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "VENV": str(VENV), **env}
    full["PATH"] = f"{VENV / 'bin'}:{full['PATH']}"  # python3 -m jaxrl_llm.chain --check
    if tmp_path is not None:  # stand-ins for gcloud / srun first on PATH
        full["PATH"] = f"{tmp_path / 'bin'}:{full['PATH']}"
    return subprocess.run(["bash", *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=300)


def _jaxrl(command: str) -> tuple[dict[str, str], list[str]]:
    """(environment assignments, `jaxrl-llm ...` argv) of a remote shell command line."""
    words = shlex.split(command.split("&&")[-1])
    env = {}
    while words[0] in ("exec", "env") or "=" in words[0]:
        if "=" in words[0]:
            key, _, value = words[0].partition("=")
            env[key] = value
        words = words[1:]
    assert words[:2] == ["jaxrl-llm", "online"], command
    return env, words


def _role(argv: list[str]) -> tuple[str, int | None, list[str]]:
    """(role, worker id or None, the argv without --role / --worker)."""
    rest, role, worker, i = [], None, None, 0
    while i < len(argv):
        if argv[i] in ("--role", "--worker"):
            role, worker = (argv[i + 1], worker) if argv[i] == "--role" else (role,
                                                                             int(argv[i + 1]))
            i += 2
        else:
            rest.append(argv[i])
            i += 1
    assert role in ("trainer", "worker"), argv
    return role, worker, rest


def _check_the_rest(argv: list[str], exchange: str, workers: int, extra: list[str]) -> None:
    """Besides --role/--worker: a command line today's CLI parses, on CONFIG, with the shared
    keys then the user's overrides; the overrides the online schema knows validate."""
    args = build_parser().parse_args(argv[1:])
    assert args.config == CONFIG
    overrides = argv[argv.index(CONFIG) + 1:]
    assert overrides == [f"online.exchange={exchange}", f"online.workers={workers}",
                         "online.sampler_devices=0", *extra]
    known = [o for o in overrides
             if not o.startswith("online.") or o.split("=")[0][7:] in OnlineSection.model_fields]
    load_config(ROOT / CONFIG, known, schema=OnlineConfig)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_scripts_parse(script):
    assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0
    if shutil.which("shellcheck"):
        proc = subprocess.run(["shellcheck", "-x", "-s", "bash", script], cwd=ROOT,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


def _tpu_lines(out: str) -> list[list[str]]:
    lines = [shlex.split(line) for line in out.splitlines() if line.strip()]
    for argv in lines:
        assert argv[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"], argv
    return lines


def _flag(argv: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] if "=" in a else argv[i + 1]
                for i, a in enumerate(argv) if a == name or a.startswith(name + "=")]
    return value


@pytest.mark.parametrize("hosts", [1, 3])
def test_tpu_dry_run_prints_one_trainer_job_and_one_worker_per_sampler_host(hosts):
    exchange = "gs://my-bucket/exchange"
    proc = _run(["launch/tpu_pipeline.sh", "--dry-run", "run", "tr-pod", "sa-pod", "us-west4-a",
                 CONFIG, exchange, "online.rounds=7"], SAMPLER_HOSTS=str(hosts), PROJECT="p1")
    assert proc.returncode == 0, proc.stderr
    lines = _tpu_lines(proc.stdout)
    assert len(lines) == 1 + hosts
    seen: list[int] = []
    for argv in lines:
        assert _flag(argv, "--zone") == "us-west4-a" and _flag(argv, "--project") == "p1"
        env, command = _jaxrl(_flag(argv, "--command"))
        role, worker, rest = _role(command)
        _check_the_rest(rest, exchange, hosts, ["online.rounds=7"])
        if role == "trainer":  # one SPMD job: the same command on every trainer worker
            assert argv[5] == "tr-pod" and _flag(argv, "--worker") == "all" and worker is None
            assert env == {}
        else:  # worker K on sampler host K, standalone on a multi-host slice
            assert argv[5] == "sa-pod" and _flag(argv, "--worker") == str(worker)
            assert env.get("TPU_HOST_BOUNDS") == ("1,1,1" if hosts > 1 else None)
            seen.append(worker)
    assert sorted(seen) == list(range(hosts))
    assert sum(_role(_jaxrl(_flag(a, "--command"))[1])[0] == "trainer" for a in lines) == 1


def test_tpu_refuses_a_local_exchange_and_an_unknown_host_count():
    proc = _run(["launch/tpu_pipeline.sh", "--dry-run", "run", "t", "s", "z", CONFIG,
                 "/tmp/exchange"], SAMPLER_HOSTS="2")
    assert proc.returncode == 2 and "gs://BUCKET/DIR" in proc.stderr and proc.stdout == ""
    proc = _run(["launch/tpu_pipeline.sh", "--dry-run", "run", "t", "s", "z", CONFIG, "gs://b/x"],
                SAMPLER_HOSTS="")
    assert proc.returncode == 2 and "SAMPLER_HOSTS" in proc.stderr and proc.stdout == ""


def test_tpu_stop_kills_only_the_online_processes_on_both_slices():
    proc = _run(["launch/tpu_pipeline.sh", "--dry-run", "stop", "tr-pod", "sa-pod", "z"])
    lines = _tpu_lines(proc.stdout)
    assert [(a[5], _flag(a, "--worker")) for a in lines] == [("tr-pod", "all"), ("sa-pod", "all")]
    for argv, role in zip(lines, ("trainer", "worker"), strict=True):
        assert _flag(argv, "--command") == (f"pkill -f '[j]axrl-llm online --config .* --role "
                                            f"{role}' || true")


def _slurm_lines(out: str) -> list[tuple[str, dict[str, str], list[str]]]:
    """(node, environment, jaxrl-llm argv) of each printed srun line."""
    out_lines = []
    for line in filter(str.strip, out.splitlines()):
        argv = shlex.split(line)
        assert argv[0] == "srun" and "--nodes=1" in argv and "--ntasks=1" in argv, argv
        assert argv[-3:-1] == ["bash", "-c"] and argv[-1].startswith(f". {VENV}/bin/activate")
        node = _flag(argv, "--nodelist")
        out_lines.append((node, *_jaxrl(argv[-1])))
    return out_lines


def test_slurm_dry_run_prints_rollout_nodes_then_one_trainer_job():
    nodes = ["gpu01", "gpu02", "gpu03", "gpu04", "gpu05"]
    proc = _run(["launch/slurm_pipeline.sbatch", "--dry-run", CONFIG, "exchange",
                 "online.rounds=7"], NODES=" ".join(nodes), ROLLOUT_NODES="2", PORT="23456")
    assert proc.returncode == 0, proc.stderr
    lines = _slurm_lines(proc.stdout)
    assert [node for node, _, _ in lines] == nodes  # each node runs one command
    exchange = str(ROOT / "exchange")  # relative: from the submit directory, for every node
    workers, trainers = {}, {}
    for node, env, command in lines:
        role, worker, rest = _role(command)
        _check_the_rest(rest, exchange, 2, ["online.rounds=7"])
        if role == "worker":
            assert env == {} and worker not in workers
            workers[worker] = node
        else:
            assert worker is None
            assert env["JAXRL_COORDINATOR"] == "gpu03:23456"  # the first trainer node
            assert env["JAXRL_NUM_PROCESSES"] == "3"
            trainers[int(env["JAXRL_PROCESS_ID"])] = node
    assert workers == {0: "gpu01", 1: "gpu02"}
    assert trainers == {0: "gpu03", 1: "gpu04", 2: "gpu05"}


def test_slurm_refuses_an_allocation_without_a_trainer_node():
    proc = _run(["launch/slurm_pipeline.sbatch", "--dry-run", CONFIG, "/shared/x"],
                NODES="a b", ROLLOUT_NODES="2")
    assert proc.returncode == 2 and "ROLLOUT_NODES=2 of 2 node(s)" in proc.stderr
    assert proc.stdout == ""


def _stand_in(tmp_path: Path, name: str, fail_on: str, sides: int) -> Path:
    """An executable `name` that logs its arguments, then fails (exit 3) when they contain
    `fail_on` (once all `sides` have logged theirs), else sleeps until killed (a side that
    keeps running)."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    log = tmp_path / f"{name}.log"
    script = tmp_path / "bin" / name
    script.write_text(f"#!/usr/bin/env bash\nprintf '%q ' \"$@\" >> {log}\necho >> {log}\n"
                      f"if [[ \"$*\" == *{shlex.quote(fail_on)}* ]]; then\n"
                      f"  while (( $(wc -l < {log}) < {sides} )); do sleep 0.1; done\n"
                      "  echo failing; exit 3\nfi\n"
                      "exec sleep 120\n")
    script.chmod(0o755)
    return log


@pytest.mark.parametrize("layout", ["tpu", "slurm"])
def test_the_real_path_starts_the_printed_commands_and_stops_all_when_one_fails(tmp_path, layout):
    if layout == "tpu":
        args = ["launch/tpu_pipeline.sh", "run", "tr", "sa", "z", CONFIG, "gs://b/x"]
        env = {"SAMPLER_HOSTS": "2"}
        log = _stand_in(tmp_path, "gcloud", "--worker 1 ", 3)
    else:
        args = ["launch/slurm_pipeline.sbatch", CONFIG, "/shared/x"]
        env = {"NODES": "a b c", "ROLLOUT_NODES": "2"}
        log = _stand_in(tmp_path, "srun", "--worker 1 ", 3)
    printed = _run([args[0], "--dry-run", *args[1:]], **env).stdout.splitlines()
    proc = _run(args, tmp_path, **env)
    assert proc.returncode == 3, proc.stderr
    ran = [shlex.split(line) for line in log.read_text().splitlines()]
    assert sorted(ran) == sorted(shlex.split(line)[1:] for line in printed)
    assert "[worker 1] failing" in proc.stdout
    assert "[worker 1] exited with status 3" in proc.stderr
    assert proc.stderr.count("stopping [") == 2  # the trainer and worker 0, still running
