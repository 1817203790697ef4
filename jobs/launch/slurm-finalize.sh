# Runs once every encode rank of the array has succeeded (--dependency=afterok): merges their partitions
# into one index and publishes the dataset version. Safe to re-run by hand if it fails.
exec {{python}} -m {{program}}
