#!/usr/bin/env bash
# Train on GPU nodes under Slurm: one process per node, each driving the node's GPUs.
#
#   sbatch --nodes=2 scripts/launch_slurm.sh CONFIG WORKDIR [--config.x=y ...]
#
# Every task gets the coordinator (port 12355 on the job's first node), the number of processes
# and its own id from the Slurm environment. WORKDIR must be on a file system every node sees.
# Slurm sends SIGTERM 5 minutes before the time limit (or on preemption): every process saves a
# checkpoint at the next step boundary and exits 0, and the requeued job (or a rerun of this
# command) continues from it. See docs/pods.md.
#
#SBATCH --job-name=stabledrl
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --signal=TERM@300
#SBATCH --requeue
#SBATCH --output=stabledrl-%j.log
set -euo pipefail

if [[ "${1:-}" == --task ]]; then  # One task (process), started by srun below.
  shift
  : "${COORDINATOR_ADDRESS:?}" "${SLURM_NTASKS:?}" "${SLURM_PROCID:?}"
  config=$1 workdir=$2
  shift 2
  command=(python -m stabledrl_jax.train "--config=$config" "--workdir=$workdir"
           "--coordinator_address=$COORDINATOR_ADDRESS" "--num_processes=$SLURM_NTASKS"
           "--process_id=$SLURM_PROCID" "$@")
  if [[ "${DRY_RUN:-0}" == 1 ]]; then printf '%q ' "${command[@]}"; echo; exit 0; fi
  exec "${command[@]}"
fi

[[ $# -ge 2 ]] || { sed -n '2,4p' "$0" >&2; exit 2; }
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export COORDINATOR_ADDRESS="$head_node:${COORDINATOR_PORT:-12355}"
# sbatch runs a copy of this script from the spool directory; srun needs the checkout's copy.
script="${SLURM_SUBMIT_DIR:-$PWD}/scripts/launch_slurm.sh"
srun --kill-on-bad-exit=1 bash "$script" --task "$@"
