"""Checkpoints: find, fetch and read them (full or sharded), consolidate shards, the run record they carry,
retention."""
