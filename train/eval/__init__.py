"""Evaluation: the held-out loss at fixed timesteps and noise (during training and `train eval`), and image
quality over guidance (`train eval-images`: FID, KID, CLIP score)."""
