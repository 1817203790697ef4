"""Weights out of a run: the diffusers pipeline export and the sample grids rendered during training."""
