"""The trainer section of `make bench`: the real Composer trainer over the bench dataset, its batches timed
part by part and as a run runs them (batches.py) with the host read-backs counted per step (syncs.py), the
same trainer as the recipe runs on a cluster, FSDP and microbatch included, on one device (as_recipe.py),
and what those numbers say (report.py)."""
