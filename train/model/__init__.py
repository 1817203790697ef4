"""The model being trained: the diffusers U-Net assembled from a preset, the diffusion objective, the
online text tower, and how its GPU kernels are picked (cuDNN autotuning, compile under FSDP)."""
