"""Issue 30 (4): the VAE encoder's speed switches (encoder.low_precision_norms, encoder.compile) and the VAE
alone as `make bench` times it (encode/vae_speed.py), on the tiny preset's VAE on CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from encode.process.encoders import speed_up_vae
from encode.vae_speed import vae_speed
from shared.models import build_vae
from shared.norms import count_low_precision_norms
from shared.presets import get_preset, random_init
from shared.runtime.device import resolve_device_setup


def tiny_vae() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_vae(random_init(get_preset("tiny")))


def test_switches_swap_the_norms_and_compile_the_encoder_keeping_the_weights() -> None:
    vae = tiny_vae()
    before = {k: v.clone() for k, v in vae.state_dict().items()}
    speed_up_vae(vae, low_precision_norms=True, compile=True)
    assert count_low_precision_norms(vae) > 0
    assert vae.encoder._compiled_call_impl is not None  # compiled lazily at its first batch
    assert all(torch.equal(before[k], v) for k, v in vae.state_dict().items())
    plain = tiny_vae()
    speed_up_vae(plain, low_precision_norms=False, compile=False)
    assert count_low_precision_norms(plain) == 0 and plain.encoder._compiled_call_impl is None


def test_vae_alone_per_resolution_and_switch() -> None:
    setup = resolve_device_setup("cpu", "fp32", False)
    out = vae_speed(tiny_vae(), [32, 64], 2, 1, "fp16", setup, compile=False)
    assert set(out) == {"32", "64"}
    for runs in out.values():
        assert set(runs) == {"as_built", "low_precision_norms"}
        for run in runs.values():
            assert run["images_per_s"] > 0 and run["precision_timed"] == "fp32"  # CPU times fp32
            error = run["error_over_std_at_fp16"]  # fp16 under CPU autocast vs strict fp32
            assert 0 <= error["median"] <= error["max"] < 10


def test_compiled_encoder_makes_one_static_graph_per_image_size_padding_short_batches() -> None:
    import numpy as np
    from torch._dynamo.testing import CompileCounter

    from encode.config import EncodeConfig
    from encode.process.encoders import compile_vae_encoder, image_sizes, load_encoders
    from shared.config import load_config

    overrides = ["source.uri=unused", "output.uri=unused", "encoder.device=cpu", "encoder.batch_size=4"]
    cfg = load_config(EncodeConfig, "sample", overrides, kind="datasets")
    encoders = load_encoders(cfg)
    rng = np.random.default_rng(0)
    sizes = sorted(image_sizes(cfg))
    assert len(sizes) == 2
    batches = [
        [rng.integers(0, 256, (*size, 3), dtype=np.uint8) for _ in range(n)]
        for size in sizes
        for n in (4, 3, 1)
    ]
    eager = [encoders.encode_images(b) for b in batches]
    assert len(encoders.vae_input_shapes) == 6  # eager: a shape per batch length (cuDNN autotuning stays off)
    encoders.vae_input_shapes.clear()
    torch._dynamo.reset()
    counter = CompileCounter()
    compile_vae_encoder(encoders.vae, len(sizes), backend=counter)
    compiled = [encoders.encode_images(b) for b in batches]
    assert counter.frame_count == len(sizes)  # the short batches ran padded in the full batch's graph
    assert sorted(encoders.vae_input_shapes.values()) == [3, 3] and all(
        shape[0] == 4 for shape in encoders.vae_input_shapes
    )  # what make bench's encode section reports as vae_input_shapes
    for (mean, logvar), (want_mean, want_logvar) in zip(compiled, eager, strict=True):
        assert mean.shape == want_mean.shape
        np.testing.assert_allclose(mean, want_mean, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(logvar, want_logvar, rtol=1e-4, atol=1e-5)


def test_cudnn_autotunes_only_a_compiled_encoders_static_shapes() -> None:
    """Eager batches come in every length a partition leaves: each would be autotuned anew (the H200's
    pipeline ran its VAE at half its speed alone). A compiled encoder pads to one shape per image size."""
    from encode.process.encoders import encode_kernel_settings, use_encode_kernel_settings

    before = torch.backends.cudnn.benchmark
    try:
        use_encode_kernel_settings(True, torch.device("cuda"))
        assert torch.backends.cudnn.benchmark
        with encode_kernel_settings(False, torch.device("cuda")):  # the bench, after its train sections
            assert not torch.backends.cudnn.benchmark
        assert torch.backends.cudnn.benchmark  # restored
        use_encode_kernel_settings(True, torch.device("cpu"))
        assert not torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark = before


def test_the_bench_encodes_with_the_jobs_switches(tmp_path: Path) -> None:
    """`encode.encoder_overrides` reach the encoders the bench's pipeline and stages run, as load_encoders
    applies them: norms swapped, the encoder compiled, short batches padded to the config's batch."""
    from encode.bench import EncodeBenchConfig, bench_encoders, encode_config

    setup = resolve_device_setup("cpu", "fp32", False)
    plan = EncodeBenchConfig(
        batch_size=6, encoder_overrides=["encoder.compile=true", "encoder.low_precision_norms=true"]
    )
    cfg = encode_config(plan, "tiny", tmp_path / "src", tmp_path / "out", setup)
    assert cfg.encoder.compile and cfg.encoder.low_precision_norms and cfg.encoder.batch_size == 6
    encoders = bench_encoders("tiny", setup, cfg)
    assert (
        count_low_precision_norms(encoders.vae) > 0 and encoders.vae.encoder._compiled_call_impl is not None
    )
    assert encoders.batch_size == 6
    plain = bench_encoders("tiny", setup)  # the VAE as built, for vae_speed's baseline
    assert count_low_precision_norms(plain.vae) == 0 and plain.vae.encoder._compiled_call_impl is None
