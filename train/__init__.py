"""Stage 2: stream encoded latents into an EMA-tracked diffusers U-Net with Composer (`python -m train`)."""
