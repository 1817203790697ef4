# Rendezvous: node 0 of the allocation hosts it; every node's torchrun connects there. (The whole list is
# read first: `| head -n 1` would kill scontrol with SIGPIPE on a long list, failing the job under pipefail.)
NODE_HOSTS="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"
MASTER_ADDR="${NODE_HOSTS%%$'\n'*}"
MASTER_PORT={{master_port}}
export MASTER_ADDR MASTER_PORT
echo "{{name}}: {{layout}}, rendezvous at $MASTER_ADDR:$MASTER_PORT"

# One task per node; each starts torchrun, which starts one rank per GPU. NODE_RANK is exported as the
# Slurm node id because torchrun does not set it and Composer names per-node signal files by it.
# --kill-on-bad-exit: one failed node ends the step at once instead of leaving the others blocked.
# --cpus-per-task: the node's every CPU for its ranks and data loaders (srun's default is one CPU per task).
srun --nodes={{nodes}} --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 bash -c '
export NODE_RANK="$SLURM_NODEID"
exec "$0" --nnodes={{nodes}} --nproc-per-node={{gpus_per_node}} --node-rank="$SLURM_NODEID" \
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" "$@"' {{torchrun}} -m {{program}}
