"""The planner's per-step communication and checkpoint formulas against hand arithmetic (SD2-base)."""

from __future__ import annotations

import pytest

from shared.estimate.cluster import (
    FSDP_HOST_SECONDS_PER_STEP,
    PRESET_PARAMS,
    checkpoint_cost,
    host_bound_note,
    min_interval_for_share,
    save_share,
    step_comm,
    step_seconds,
)

P = 865_910_724  # SD2-base U-Net parameters (NOTES: 865.9 M)


def test_shard_grad_op_gathers_and_scatters_once_per_microbatch() -> None:
    one = step_comm(P, 256, 1, "SHARD_GRAD_OP", param_bytes=2, reduce_bytes=4)
    assert (one.all_gathers, one.reduce_scatters, one.all_reduces) == (1, 1, 0)
    assert one.all_gather_bytes == pytest.approx(1.72506e9, rel=1e-5)  # 255/256 x P x 2
    assert one.reduce_scatter_bytes == pytest.approx(3.45011e9, rel=1e-5)  # 255/256 x P x 4
    two = step_comm(P, 256, 2, "SHARD_GRAD_OP", 2, 4)
    assert two.total_bytes == pytest.approx(2 * one.total_bytes)  # accumulation repeats both
    assert step_comm(P, 256, 1, "SHARD_GRAD_OP", 2, 2).reduce_scatter_bytes == pytest.approx(
        1.72506e9, rel=1e-5
    )


def test_full_shard_no_shard_and_ddp() -> None:
    full = step_comm(P, 8, 2, "FULL_SHARD", 2, 4)
    assert (full.all_gathers, full.reduce_scatters) == (4, 2)
    assert full.all_gather_bytes == pytest.approx(4 * 7 / 8 * P * 2)
    assert step_comm(P, 8, 2, "NO_SHARD", 2, 4).all_reduce_bytes == pytest.approx(2 * 2 * 7 / 8 * P * 4)
    ddp = step_comm(P, 8, 2, "DDP", 4, 4)  # no_sync: one all-reduce per optimizer step
    assert (ddp.all_reduces, ddp.all_reduce_bytes) == (1, pytest.approx(2 * 7 / 8 * P * 4))


def test_checkpoint_size_save_time_and_share() -> None:
    assert PRESET_PARAMS["sd2-base"] == P
    ckpt = checkpoint_cost(P, 256, 32, write_gb_per_s_per_node=1.0)
    assert ckpt.total_bytes == 16 * P == pytest.approx(13.8546e9, rel=1e-5)  # 4 + 4 + 8 bytes per param
    assert ckpt.per_rank_bytes == pytest.approx(54.12e6, rel=1e-3)
    assert (ckpt.full_save_s, ckpt.sharded_save_s) == (
        pytest.approx(13.8546, rel=1e-5),
        pytest.approx(0.43296, rel=1e-4),
    )
    step = step_seconds(2048, 184.6, 256)
    assert step == pytest.approx(0.043337, rel=1e-4)
    assert save_share(ckpt.full_save_s, 2500, step) == pytest.approx(13.8546 / (108.342 + 13.8546), rel=1e-4)
    assert save_share(ckpt.sharded_save_s, 2500, step) == pytest.approx(0.0039803, rel=1e-3)
    interval = min_interval_for_share(ckpt.full_save_s, step)
    assert (
        save_share(ckpt.full_save_s, interval, step)
        < 0.01
        <= save_share(ckpt.full_save_s, interval - 1, step)
    )
    at_512 = step_seconds(2048, 42.2, 256)  # 189.6 ms
    assert save_share(ckpt.sharded_save_s, 2500, at_512) == pytest.approx(0.000913, rel=1e-2)


def test_no_sync_communicates_once_per_step_under_shard_grad_op() -> None:
    """The train job's FSDP no_sync (counted in tests/train/bench/test_bench_scale_counters.py)."""
    once = step_comm(P, 8, 1, "SHARD_GRAD_OP", 2, 4)
    assert step_comm(P, 8, 4, "SHARD_GRAD_OP", 2, 4, no_sync=True) == once
    full = step_comm(P, 8, 4, "FULL_SHARD", 2, 4, no_sync=True)  # re-gathers, reduces once
    assert (full.all_gathers, full.reduce_scatters) == (8, 1)
    assert step_comm(P, 8, 4, "NO_SHARD", 2, 4, no_sync=True).all_reduces == 1


def test_tiny_preset_parameter_count_matches_its_unet() -> None:
    """The dry run prices a tiny run's communication and checkpoint with this count."""
    from shared.models import build_unet
    from shared.presets import get_preset

    unet = build_unet(get_preset("tiny"))
    assert PRESET_PARAMS["tiny"] == sum(p.numel() for p in unet.parameters())


def test_host_bound_note_caps_the_rate_at_the_hosts_work_a_step() -> None:
    """8 images a microbatch under per-block FSDP: at most 8 / 0.275 s = 29.1 img/s per GPU (issue 30's sixth
    H200 run), whatever the device could do; a device slower than the host, or no FSDP, gets no note."""
    assert FSDP_HOST_SECONDS_PER_STEP == 0.275
    note = host_bound_note(True, 8, 184.6)
    assert "needs 43 ms a microbatch" in note and "at most 29.1 img/s per GPU, 6.3x the estimate's" in note
    assert host_bound_note(True, 128, 184.6) == ""  # 693 ms of device work a step: the device sets the pace
    assert host_bound_note(False, 8, 184.6) == ""  # DDP: not measured
    assert "; or fsdp=false: " not in note


def test_host_bound_note_offers_ddp_where_its_unsharded_state_fits_the_gpu() -> None:
    """SD2-base's 17.3 GB of unsharded state (fp32 weights, grads, AdamW, EMA) and 8 images fit a 40 GB A100
    at either resolution; 32 images at 512 px (+30 GB of activations) do not, and then nothing is offered."""
    from shared.estimate.memory import ddp_alternative

    ddp = ddp_alternative("A100-40GB", "sd2-base", 256, 8)
    assert ddp.startswith("DDP keeps the whole 17.3 GB of state on every GPU (19.3 GB of 40 with 8 images)")
    assert "4,942 ATen ops and 8,948 Python calls unwrapped, 11,623 and 64,774 under per-block FSDP" in ddp
    assert "DDP adds 2 ops a gradient, its bucket view and a 1/world scaling: 686 kernels" in ddp
    note = host_bound_note(True, 8, 184.6, ddp)
    assert f"(the memory line: fewer GPUs); or fsdp=false: {ddp}; or measure yours" in note
    assert ddp_alternative("A100-40GB", "sd2-base", 512, 8).startswith("DDP keeps")
    assert ddp_alternative("A100-40GB", "sd2-base", 512, 32) == ""
    assert ddp_alternative("A100-40GB", "tiny", 96, 8) == ""  # no activations measured


def test_state_update_is_48_bytes_a_parameter_on_every_rank_under_ddp_and_1_over_w_under_fsdp() -> None:
    """Issue 30: the clipping norm (4), the fused AdamW step that stores the unscaled gradient (32) and the
    EMA lerp (12) after every backward; SD2-base: 41.6 GB a step, 8.66 ms at an H200's 4.8 TB/s, 26.7 ms at
    an A100-40GB's 1.555 TB/s; 1/256 of it under SHARD_GRAD_OP on 256 ranks."""
    from shared.estimate.cluster import state_update
    from shared.estimate.gpus import GPU_TABLE

    ddp = state_update(P, 256, "DDP", clipping=True, ema_interval=1)
    assert (ddp.bytes_per_param, ddp.sharded) == (48, False)
    assert ddp.per_rank_bytes == pytest.approx(48 * P) == pytest.approx(41.564e9, rel=1e-4)
    assert ddp.seconds(GPU_TABLE["H200"].memory_tb_s) == pytest.approx(8.659e-3, rel=1e-3)
    assert ddp.seconds(GPU_TABLE["A100-40GB"].memory_tb_s) == pytest.approx(26.73e-3, rel=1e-3)
    assert state_update(P, 256, "NO_SHARD", True, 1).per_rank_bytes == ddp.per_rank_bytes
    for strategy in ("SHARD_GRAD_OP", "FULL_SHARD"):
        sharded = state_update(P, 256, strategy, True, 1)
        assert sharded.sharded and sharded.per_rank_bytes == pytest.approx(48 * P / 256)
    assert not state_update(P, 1, "SHARD_GRAD_OP", True, 1).sharded  # one rank holds everything
    # no clipping: no norm, and the fused kernel keeps the gradient (28); EMA every 10 batches: 12 / 10
    assert state_update(P, 8, "DDP", clipping=False, ema_interval=1).bytes_per_param == 40
    assert state_update(P, 8, "DDP", True, ema_interval=10).bytes_per_param == pytest.approx(37.2)
    assert state_update(P, 8, "DDP", True, ema_interval=None).bytes_per_param == 36
    assert ddp.parts == ("clipping norm", "fused AdamW", "EMA lerp")
    assert state_update(P, 8, "DDP", clipping=False, ema_interval=None).parts == ("fused AdamW",)
    assert state_update(P, 8, "DDP", True, ema_interval=10).ema_bytes_per_param == pytest.approx(1.2)
    assert all(gpu.memory_tb_s > 0 for gpu in GPU_TABLE.values())


def test_one_rank_or_a_sharded_update_gets_no_note_and_an_unknown_preset_no_device_time() -> None:
    from shared.estimate.cluster import state_update, state_update_lines, unet_device_seconds

    device_s = unet_device_seconds("sd2-base", 256, 8, "H200")
    assert device_s == pytest.approx(8 * 543e9 / (989e12 * 0.35))
    assert unet_device_seconds("tiny", 256, 8, "H200") is None
    assert unet_device_seconds("sd2-base", 768, 8, "H200") is None
    images = "8 images at 256 px"
    for update in (state_update(P, 1, "DDP", True, 1), state_update(P, 256, "SHARD_GRAD_OP", True, 1)):
        line, note = state_update_lines(update, "DDP", "H200", True, device_s, images)
        assert line.startswith("state update per rank per step") and note == ""
    line, note = state_update_lines(state_update(P, 8, "DDP", True, 1), "DDP", "H200", True, device_s, images)
    assert "69% on top of the U-Net's own 12.5 ms for 8 images at 256 px at 35% MFU" in note


def test_ddp_alternative_prices_its_replicated_state_update() -> None:
    from shared.estimate.memory import ddp_alternative

    ddp = ddp_alternative("H200", "sd2-base", 256, 8)
    update = "whole state update on every GPU (clipping norm, fused AdamW, EMA lerp: 41.6 GB a step, 8.7 ms"
    assert update in ddp
    assert "at the H200's 4.8 TB/s; 1/world of it under FSDP)" in ddp
