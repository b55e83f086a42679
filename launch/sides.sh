# Sourced by launch/tpu_pipeline.sh and launch/slurm_pipeline.sbatch: start the pipeline's
# sides (trainer, rollout workers) side by side and wait for them, or only print them.
# shellcheck shell=bash
: "${dry_run:?set dry_run=0 (start) or 1 (print) before sourcing launch/sides.sh}"

declare -A running=()  # pid -> label

# quoted WORD...: the words as one shell command line (plain words bare, others in quotes).
quoted() {
  local word out=()
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=("$word"); else out+=("${word@Q}"); fi
  done
  echo "${out[*]}"
}

# show_or_start LABEL COMMAND...: print the command line (dry run), or start it in the
# background with its output prefixed by [LABEL].
show_or_start() {
  local label=$1
  shift
  if ((dry_run)); then
    quoted "$@"
    return
  fi
  if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 501)); then
    echo "launching needs bash >= 5.1 (wait -n -p); this is bash $BASH_VERSION (--dry-run works)" >&2
    exit 2
  fi
  echo "+ [$label] $(quoted "$@")" >&2
  "$@" > >(sed -u "s/^/[$label] /") 2>&1 &
  running[$!]=$label
}

# wait_sides: wait for every started side; the first that fails has the others killed (their
# launching process: ssh / srun) and its status returned.
wait_sides() {
  local pid rc
  while ((${#running[@]})); do
    rc=0
    wait -n -p pid "${!running[@]}" || rc=$?
    echo "[${running[$pid]}] exited with status $rc" >&2
    unset "running[$pid]"
    if ((rc)); then
      for pid in "${!running[@]}"; do
        echo "stopping [${running[$pid]}]" >&2
        kill "$pid" 2>/dev/null || true
      done
      return "$rc"
    fi
  done
}
