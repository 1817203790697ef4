"""Stage 1: images + captions -> VAE latents and text embeddings as versioned MDS shards (`python -m
encode`)."""
