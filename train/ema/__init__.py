"""The EMA of the U-Net weights: Composer's EMA with name-keyed stores, sharded under FSDP, and the phase
handoff."""
