"""Code used by both stages: the data contract, manifests, model presets, storage and config loading, and
what a running job holds (`leases` on a dataset version, `claims` on work no other job may do beside it).

Kept light on purpose: nothing here imports Composer, so the encode job never pays for train's imports.
Heavy libraries (torch, diffusers, transformers, open_clip) are imported inside the functions that need them.
"""
