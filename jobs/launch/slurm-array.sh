# Each array task is one encode rank on one GPU. The ranks share no process group (MASTER_ADDR unset), so
# they start, fail and are retried independently; the finalize job, submitted with
# --dependency=afterok:<this array>, merges the index once every one of them has succeeded.
unset MASTER_ADDR MASTER_PORT
export RANK="$SLURM_ARRAY_TASK_ID" WORLD_SIZE={{world_size}} LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 NODE_RANK=0
echo "{{name}}: encode rank $RANK of $WORLD_SIZE on $(hostname)"
exec {{python}} -m {{program}}
