"""The training loop around Composer: stages that build and run the trainer, the lean step, clipping,
guards, metrics."""
