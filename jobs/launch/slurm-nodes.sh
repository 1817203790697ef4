# Rendezvous (torchrun's elastic agent, c10d): node 0 of the allocation hosts it; every node's torchrun
# connects there. (The whole list is read first: `| head -n 1` would kill scontrol with SIGPIPE on a long
# list, failing the job under pipefail.)
NODE_HOSTS="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"
MASTER_ADDR="${NODE_HOSTS%%$'\n'*}"
MASTER_PORT={{master_port}}
export MASTER_ADDR MASTER_PORT
SEGMENT="${SLURM_RESTART_COUNT:-0}"
# One rendezvous run id per job and segment: a requeued segment never meets a stale round of the last one.
RDZV_ID="{{name}}-$SLURM_JOB_ID-$SEGMENT"
export RDZV_ID
echo "{{name}}: {{layout}}, rendezvous $RDZV_ID at $MASTER_ADDR:$MASTER_PORT"

# Unattended (docs/running-unattended.md): torchrun's elastic agent restarts every node's ranks together from
# the last checkpoint when any rank fails (--max-restarts); each node's torchrun runs under a supervisor
# (python -m shared.launch.supervise) that kills its node's ranks when one hangs (so every node restarts),
# stops a crash loop, and on USR1 / TERM asks the ranks to save the current step and exit 75 (resumable). The supervisor also reads
# this job's EndTime and has the ranks save {{lead_s}} s before it; `--signal=B:USR1@{{lead_s}}` above is
# the backstop. After a resumable stop the job requeues itself (same run name, so it resumes) up to
# resilience.max_requeues={{max_requeues}} times.
echo "{{name}}: segment $SEGMENT (requeues so far: $SEGMENT of at most {{max_requeues}}), started $(date -u +%FT%TZ)"
ask_ranks_to_save() {
  echo "{{name}}: $1 received: asking the ranks to save the current step and exit"
  kill -USR1 "$SRUN_PID" 2>/dev/null || true  # srun forwards it to every node's supervisor
}
trap 'ask_ranks_to_save USR1' USR1
trap 'ask_ranks_to_save TERM' TERM
# A node whose ranks saved and stopped (resumable) marks it here and exits 0: srun's --kill-on-bad-exit takes
# any other code for a failure and SIGKILLs the nodes still finishing their part of the same save.
STOPPED=".slurm-stopped-$SLURM_JOB_ID-$SEGMENT"
export STOPPED

# One task per node; each starts the supervisor, which starts torchrun, which starts one rank per GPU.
# NODE_RANK (the Slurm node id) labels the node's log lines; the ranks take Composer's NODE_RANK from the
# rendezvous. --kill-on-bad-exit: a node whose supervisor stopped (restarts spent, a crash loop) ends the
# step at once instead of leaving the others waiting in the rendezvous. --cpus-per-task: the node's every
# CPU for its ranks and data loaders (srun's default is one CPU per task).
srun --nodes={{nodes}} --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 bash -c '
export NODE_RANK="$SLURM_NODEID"
exec {{python}} -m shared.launch.supervise {{supervise_flags}} --stopped-mark "$STOPPED/node-$SLURM_NODEID" \
  -- "$0" {{torchrun_flags}} "$@"' \
  {{torchrun}} -m {{program}} &
SRUN_PID=$!
# A trapped signal makes `wait` return early (128 + its number): wait again while srun itself still runs.
set +e
wait "$SRUN_PID"
RC=$?
while kill -0 "$SRUN_PID" 2>/dev/null; do
  wait "$SRUN_PID"
  RC=$?
done
# Resumable when every node marked that its ranks saved and stopped, whatever `wait` said: a signal that
# arrives as srun exits cuts the last `wait` short, and bash then reports 128 + the signal (or -1) for srun.
MARKS="$(ls -A "$STOPPED" 2>/dev/null | wc -l)"
if [ "$MARKS" -ge {{nodes}} ] || { [ "$RC" -eq 0 ] && [ "$MARKS" -gt 0 ]; }; then
  RC=75
fi
rm -rf "$STOPPED"
set -e
if [ "$RC" -eq 75 ]; then
  if [ "$SEGMENT" -lt {{max_requeues}} ]; then
    echo "{{name}}: saved and stopped; requeueing job $SLURM_JOB_ID as segment $((SEGMENT + 1))"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  echo "{{name}}: saved and stopped, but the {{max_requeues}} requeues of resilience.max_requeues are spent; resubmit to go on"
fi
exit "$RC"
