"""Commands beside the train job, reachable as `python -m train demo` and `python -m train tiny-vae`:
the end-to-end demo (`make demo`) and the trainer of the tiny preset's shipped VAE (`make tiny-vae`)."""
