"""bench.md's findings on numbers a GPU gives (no GPU needed)."""

from __future__ import annotations

from train.bench.report import vae_shapes_finding

PIPELINE = {"resolutions": [256, 512], "encoder_compiled": False, "cudnn_autotuning": True}


def test_autotuning_an_eager_vae_over_many_batch_lengths_is_flagged() -> None:
    """How the first H200 pipeline ran (46% of its bound): every batch length re-tuned every convolution."""
    line = vae_shapes_finding(PIPELINE | {"vae_input_shapes": 14})
    assert line == (
        "encode VAE: 14 input shapes in a pipeline run (eager, cuDNN autotuning on)"
        " - 12 more than its image sizes, each re-tuned"
    )


def test_a_padded_compiled_vae_or_an_untuned_eager_one_is_not_flagged() -> None:
    compiled = vae_shapes_finding(PIPELINE | {"vae_input_shapes": 2, "encoder_compiled": True})
    assert compiled.endswith("(compiled, short batches padded, cuDNN autotuning on)")
    eager = vae_shapes_finding(PIPELINE | {"vae_input_shapes": 14, "cudnn_autotuning": False})
    assert eager.endswith("(eager, cuDNN autotuning off)")
