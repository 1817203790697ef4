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


def test_the_encode_target_is_read_on_the_rate_once_running() -> None:
    """The sixth H200 run: 58% of its bound over a 3.85 s bench run, 1.4 s of it before the first model call
    (workers starting, the first batch decoding); 92% from the first model call to the last. An encode job
    runs for hours, so the target is read on the second; both are shown."""
    from train.bench.anatomy.report import vae_findings
    from train.bench.report import encode_findings

    encode = {
        "images_per_s_per_device": 121.2,
        "share_of_bound": 0.58,
        "bound_samples_per_s": 208.7,
        "share_of_slowest_stage": 1.6,
        "slowest_stage": "prepare",
        "vae_input_share_of_vae": 0.03,
        "steady_samples_per_s": 191.1,
        "steady_share_of_bound": 0.916,
    }
    assert vae_findings(encode) == ["encode pipeline once running at 92% of its bound: meets the 90% target"]
    assert vae_findings(encode | {"steady_share_of_bound": 0.8})[0].endswith(
        "80% of its bound: below the 90% target"
    )
    notes = encode_findings(encode)
    assert notes[0].startswith("encode pipeline 121.2 samples/s = 58% of its bound 208.7")
    assert notes[1] == (
        "encode pipeline once running (first model call to last, worker start-up left out): "
        "191.1 samples/s = 92% of its bound"
    )
