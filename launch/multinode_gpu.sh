#!/usr/bin/env bash
# Train on several GPU nodes without a scheduler: run this script on every node with the same
# settings and its own NODE_RANK. Each node runs one process that drives all its GPUs
# (launch/gpu_host.sh) and joins the others through the coordinator, process 0's host:port:
#   --coordinator_address=$COORDINATOR --num_processes=$NUM_NODES --process_id=$NODE_RANK
#
# Usage (from the repository root on each node; WORKDIR on a filesystem all nodes share, or gs://):
#   node 0:  NUM_NODES=2 NODE_RANK=0 COORDINATOR=10.0.0.1:8476 WORKDIR=/shared/runs/q7b \
#              CONFIG=configs/grpo_math.py:model=qwen2.5-7b,data=gsm8k \
#              launch/multinode_gpu.sh --config.mesh.shape='(-1,8,1)' \
#                --config.model.hf_path=/shared/models/Qwen2.5-7B-Instruct ...
#   node 1:  the same command with NODE_RANK=1
#   DRY_RUN=1 NUM_NODES=2 NODE_RANK=1 COORDINATOR=10.0.0.1:8476 WORKDIR=/shared/r \
#     launch/multinode_gpu.sh                                 # print the command, run nothing
# The arguments go to the trainer. Under SLURM use launch/slurm_gpu.sbatch instead.
#
# Settings (environment variables):
#   NUM_NODES     number of nodes = processes                       (required)
#   NODE_RANK     this node's rank, 0 .. NUM_NODES-1; 0 hosts the coordinator    (required)
#   COORDINATOR   host:port of node 0, reachable from every node    (required)
#   WORKDIR       output directory shared by all nodes              (required)
#   CONFIG        config file and presets   (configs/grpo_math.py: the mesh.shape default
#                 (-1,1,1) spreads the batch over every GPU; set --config.mesh.shape for FSDP)
#   and those of launch/gpu_host.sh: PYTHON, MAX_RESTARTS, XLA_PYTHON_CLIENT_MEM_FRACTION, DRY_RUN
# With MAX_RESTARTS=N every node reruns after exit 42 and they meet again at the coordinator.
set -euo pipefail

die() {
  echo "error: $*" >&2
  exit 1
}

need="every node needs NUM_NODES, NODE_RANK, COORDINATOR (node 0's host:port) and a shared WORKDIR"
example="e.g. NUM_NODES=2 NODE_RANK=0 COORDINATOR=10.0.0.1:8476 WORKDIR=/shared/runs/x $0"
for var in NUM_NODES NODE_RANK COORDINATOR WORKDIR; do
  [[ -n "${!var:-}" ]] || die "$var is not set; $need, $example"
done
[[ "$NUM_NODES" =~ ^[1-9][0-9]*$ ]] || die "NUM_NODES=$NUM_NODES is not a positive whole number"
if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || ((NODE_RANK >= NUM_NODES)); then
  die "NODE_RANK=$NODE_RANK is not in 0 .. $((NUM_NODES - 1))"
fi
[[ "$COORDINATOR" =~ ^[^:]+:[0-9]+$ ]] ||
  die "COORDINATOR=$COORDINATOR is not host:port (node 0's address and a free port)"

export WORKDIR
export CONFIG="${CONFIG:-configs/grpo_math.py}"
exec "$(dirname "${BASH_SOURCE[0]}")/gpu_host.sh" \
  --coordinator_address="$COORDINATOR" --num_processes="$NUM_NODES" --process_id="$NODE_RANK" "$@"
