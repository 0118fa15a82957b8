#!/usr/bin/env bash
# Train on a Cloud TPU pod slice: one process per TPU VM host, all running the same command.
#
#   scripts/launch_tpu_pod.sh setup TPU ZONE                 # install on every worker (once)
#   scripts/launch_tpu_pod.sh train TPU ZONE CONFIG WORKDIR [--config.x=y ...]
#   scripts/launch_tpu_pod.sh logs  TPU ZONE [WORKER]        # tail a worker's log (default 0)
#   scripts/launch_tpu_pod.sh stop  TPU ZONE                 # SIGTERM: save, then exit
#
# setup copies this checkout (git archive of HEAD) to every worker and installs it with
# jax[tpu] and the gcs and datasets extras (gs:// workdirs, Hub data) into ~/stabledrl-venv. train starts `python -m stabledrl_jax.train` on all workers in
# the background (it survives the ssh session; output in ~/stabledrl_train.log on each worker);
# the processes find each other through the TPU metadata, so no coordinator flags are needed.
# WORKDIR should be a gs:// bucket path that every worker can write. Rerunning `train` with the
# same WORKDIR resumes from its latest checkpoint; `stop` (or a preemption) saves first.
#
# Environment: PROJECT (gcloud --project; default: gcloud's), DRY_RUN=1 (print the gcloud
# commands instead of running them). See docs/pods.md.
set -euo pipefail

usage() { sed -n '2,7p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
action=$1 tpu=$2 zone=$3
shift 3
repo=$(cd "$(dirname "$0")/.." && pwd)
venv='$HOME/stabledrl-venv'
log='$HOME/stabledrl_train.log'
project_flag=()
[[ -n "${PROJECT:-}" ]] && project_flag=(--project "$PROJECT")

run() {  # Runs (or, with DRY_RUN=1, prints) a command.
  if [[ "${DRY_RUN:-0}" == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

on_workers() {  # on_workers WORKERS COMMAND: the command on those workers of the slice.
  run gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" "${project_flag[@]}" \
    --worker="$1" --command "$2"
}

case "$action" in
  setup)
    archive=$(mktemp -t stabledrl_jax.XXXXXX.tar.gz)
    run git -C "$repo" archive --format=tar.gz -o "$archive" HEAD
    run gcloud compute tpus tpu-vm scp "$archive" "$tpu:~/stabledrl_jax.tar.gz" --zone "$zone" \
      "${project_flag[@]}" --worker=all
    on_workers all "set -e; rm -rf ~/stabledrl_jax && mkdir ~/stabledrl_jax && \
tar -xzf ~/stabledrl_jax.tar.gz -C ~/stabledrl_jax && python3 -m venv $venv && \
$venv/bin/pip install -q -U pip && $venv/bin/pip install -q -U 'jax[tpu]' && \
$venv/bin/pip install -q -e ~/stabledrl_jax[gcs,datasets]"
    ;;
  train)
    [[ $# -ge 2 ]] || usage
    config=$1 workdir=$2
    shift 2
    overrides=$(printf ' %q' "$@")
    # Every worker runs the identical command; process ids come from the TPU runtime.
    on_workers all "cd ~/stabledrl_jax && nohup $venv/bin/python -m stabledrl_jax.train \
--config=$config --workdir=$workdir$overrides > $log 2>&1 < /dev/null &"
    echo "started on every worker of $tpu; follow with: $0 logs $tpu $zone" >&2
    ;;
  logs)
    on_workers "${1:-0}" "tail -n 100 -f $log"
    ;;
  stop)
    on_workers all "pkill -TERM -f stabledrl_jax.train || true"
    ;;
  *)
    usage
    ;;
esac
