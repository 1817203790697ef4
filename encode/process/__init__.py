"""The per-sample path: read, select, decode and resize (workers), run the frozen encoders, write
partitions."""
