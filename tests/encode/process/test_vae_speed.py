"""Issue 30 (4): the VAE encoder's speed switches (encoder.low_precision_norms, encoder.compile) and the VAE
alone as `make bench` times it (encode/vae_speed.py), on the tiny preset's VAE on CPU."""

from __future__ import annotations

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
    torch._dynamo.reset()
    counter = CompileCounter()
    compile_vae_encoder(encoders.vae, len(sizes), backend=counter)
    compiled = [encoders.encode_images(b) for b in batches]
    assert counter.frame_count == len(sizes)  # the short batches ran padded in the full batch's graph
    for (mean, logvar), (want_mean, want_logvar) in zip(compiled, eager, strict=True):
        assert mean.shape == want_mean.shape
        np.testing.assert_allclose(mean, want_mean, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(logvar, want_logvar, rtol=1e-4, atol=1e-5)
