"""`make bench`'s scale counters (issue 11) that must stay at zero, or agree with the planner, on any
cluster: host syncs per step, S3 requests per step outside checkpoints, EMA bytes per update under FSDP,
collectives per optimizer step at the shipped SD2 batch settings (vs shared/estimate/cluster.py's formulas),
all-gathers and reduce-scatters per step under gradient accumulation, and checkpoint bytes per rank, full vs
sharded. The counters are read from the JSON of the session's `make bench` run (tests/train/conftest.py
bench_alone: the real command, its S3 server and its 2-rank job), as a user or the planner reads them. Host
syncs are counted exactly; the Python-side share is a timing and only has to be measured (a loaded shared
CPU makes any bound on it flaky)."""

from __future__ import annotations

import copy

import pytest

from tests.train.conftest import BenchRun
from train.bench.report import accumulation_finding, findings, scale_findings
from train.bench.scale import planner_bytes_per_param, shipped_settings, summarize_collectives
from train.bench.scale_s3 import quiet_steps, summarize_requests

# Counted on 2 ranks: SD2's shipped settings gather bf16 params (2 bytes) once and reduce-scatter fp32
# gradients (4 bytes) once per optimizer step.
SHIPPED_BYTES_PER_PARAM = {"all_gather": 2.0, "reduce_scatter": 4.0}
# Largest |difference| of a gradient tensor, relative to its largest entry, between 4 microbatches summed in
# bf16 (no_sync) and in fp32 after each reduce-scatter: a few bf16 ulps (2**-8 = 0.4% each); 0.8% measured.
ACCUMULATION_GRAD_TOLERANCE = 0.02


@pytest.mark.slow  # the shared `make bench` run
def test_scale_section_counts_host_syncs_and_python_share(bench_alone: BenchRun) -> None:
    result = bench_alone.result
    scale = result["scale"]
    # Neither the train job nor Composer's loop reads anything back between log flushes.
    assert scale["host_syncs_per_step"] == {"train": 0, "composer": 0}
    assert scale["host_sync_places"] == []
    assert 0 <= scale["python_side_share"] < 1 and scale["python_side_share_target"] == 0.05
    trainer = result["trainer"]  # the step work is timed inside Composer's batch, and is most of it
    assert 0 < trainer["in_step_s"] < trainer["wall_per_batch_s"]
    # 1 + 6 + 2 flow batches over 8 rows: Composer fires BEFORE_DATALOADER twice at the epoch's end, and
    # that stays one batch, so every batch is timed once and the flow batches all run
    assert trainer["batches_timed"] == 6 and trainer["flow"]["batches"] == 2
    assert any(note.startswith("scale: ") for note in findings(result))


def test_quiet_steps_leave_out_start_up_each_checkpoint_and_two_windows_after_it() -> None:
    assert quiet_steps(12, 4) == [2, 3, 7, 11]
    # a request on a quiet step is what the counter reports, by operation
    by_step = {1: {"GetObject": 3}, 3: {"ListObjectsV2": 1}, 5: {"PutObject": 2}}
    summary = summarize_requests(by_step, 12, 4)
    assert summary["requests_per_step_outside_checkpoints"] == 1
    assert summary["by_operation_outside_checkpoints"] == {"ListObjectsV2": 1}
    assert summary["by_operation_checkpoint_steps"] == {"PutObject": 2}
    assert summary["by_operation_start_up"] == {"GetObject": 3}


@pytest.mark.s3
@pytest.mark.slow  # the shared `make bench` run: SeaweedFS, Composer's S3 uploader, a 2-rank job
def test_train_job_makes_no_s3_request_per_step_outside_checkpoints(bench_alone: BenchRun) -> None:
    s3 = bench_alone.result["scale"]["s3"]
    assert "skipped" not in s3, s3
    assert s3["quiet_steps"] == [2, 3, 7, 11]
    assert s3["requests_per_step_outside_checkpoints"] == 0, s3["requests_per_step"]
    assert s3["by_operation_outside_checkpoints"] == {}
    # positive control: the counter sees the checkpoint steps' mirror sync and pruning, and the claim's read
    # before each save (one GetObject a checkpoint, at steps 4, 8 and 12)
    assert [s3["requests_per_step"][str(step)] for step in (4, 8, 12)] == [1, 1, 1], s3["requests_per_step"]
    at_checkpoints = s3["by_operation_checkpoint_steps"]
    assert at_checkpoints.get("ListObjectsV2", 0) > 0 and at_checkpoints.get("PutObject", 0) > 0, (
        at_checkpoints
    )
    assert any("0 S3 requests per step" in note for note in scale_findings({"s3": s3}))


def test_shipped_sd2_settings_run_one_microbatch_per_step_at_256_gpus() -> None:
    settings = shipped_settings()
    assert (settings.strategy, settings.grad_accum, settings.microbatch) == ("SHARD_GRAD_OP", 1, 8)
    assert settings.mixed_precision["param_dtype"] == "amp_bf16"
    assert settings.mixed_precision["reduce_dtype"] == "fp32"
    assert planner_bytes_per_param(vars(settings), 1000) == SHIPPED_BYTES_PER_PARAM


@pytest.mark.dist
@pytest.mark.slow
def test_ema_moves_nothing_and_step_collectives_agree_with_the_planner(bench_alone: BenchRun) -> None:
    comm = bench_alone.result["scale"]["comm"]
    # (2) the EMA update under FSDP: no collective at all; the control shows the counter sees FSDP's gathers
    assert comm["ema_store"] == "ShardedEMAStore"
    assert comm["ema_update_bytes"] == 0 and comm["ema_update_calls"] == 0
    assert comm["full_model_gather_bytes"] >= 4 * comm["step_model_params"]  # fp32 weights, gathered
    # (3) one optimizer step at the shipped settings: the forward gathers the params once, the backward
    # reduce-scatters the grads once (no accumulation: 2 microbatches would double both), the clipping
    # norm is one scalar all-reduce, the optimizer communicates nothing. Calls are one per FSDP unit; the
    # U-Net is wrapped per ResNet / transformer block (train/model/assemble.py `is_fsdp_unit`).
    phases = comm["step_by_phase"]
    assert set(phases["forward"]["calls"]) == {"all_gather"}
    assert set(phases["backward"]["calls"]) == {"reduce_scatter_tensor"}
    assert phases["clip"]["calls"] == {"all_reduce": 1} and phases["clip"]["bytes"] == 4
    assert phases["optimizer"]["calls"] == {}
    assert comm["step_bytes_per_param"] == pytest.approx(SHIPPED_BYTES_PER_PARAM, rel=1e-3)
    assert comm["planner_agrees"], (comm["step_bytes_per_param"], comm["planner_bytes_per_param"])
    assert comm["sd2_gb_per_rank_per_step"] == pytest.approx(
        {"all_gather": 1.725, "reduce_scatter": 3.45}, abs=2e-3
    )
    # (4) checkpoints: rank 0 writes all of a full one; a sharded one splits it over both ranks
    ckpt = comm["checkpoint"]
    assert ckpt["full"]["max_rank_share"] == 1.0 and ckpt["full"]["bytes_per_rank"][1] == 0
    assert ckpt["sharded"]["max_rank_share"] < 0.75 and min(ckpt["sharded"]["bytes_per_rank"]) > 0
    assert ckpt["full"]["seconds_per_save"] > 0 and ckpt["sharded"]["seconds_per_save"] > 0
    notes = scale_findings({"comm": comm})
    assert any("moves 0 bytes" in note and "agrees" in note for note in notes), notes


def test_planner_disagreement_is_reported() -> None:
    """A step that gathers twice (e.g. accumulation back at 2) while the planner expects once."""
    raw = {
        "params": 1000,
        "settings": {**vars(shipped_settings()), "grad_accum": 1},
        "step": {
            "forward": {"calls": {"all_gather": 2}, "bytes": 2 * 3000},  # 2 bf16 gathers: 2 x 1.5 x 1000 x 2
            "backward": {"calls": {"reduce_scatter_tensor": 1}, "bytes": 6000},
            "clip": {"calls": {}, "bytes": 0},
            "optimizer": {"calls": {}, "bytes": 0},
        },
        "ema": {"update": {"calls": {}, "bytes": 0}, "full_gather": {"calls": {}, "bytes": 0}, "store": "x"},
        "checkpoint": {},
    }
    assert summarize_collectives(copy.deepcopy(raw))["step_bytes_per_param"] == {
        "all_gather": 4.0,
        "reduce_scatter": 4.0,
    }
    assert not summarize_collectives(raw)["planner_agrees"]


@pytest.mark.dist
@pytest.mark.slow
def test_accumulation_gathers_and_reduces_once_per_step_under_fsdp(bench_alone: BenchRun) -> None:
    """Issue 22 (3): with 4 microbatches per step, the train job's FSDP no_sync (train/loop/step.py
    `accumulation_sync`, the function LeanTrainer calls) all-gathers and reduce-scatters once per FSDP unit
    per step under SHARD_GRAD_OP; Composer's loop (sync every microbatch) does both 4 times. FULL_SHARD
    frees the parameters after each forward and backward, so only its reduce-scatters drop. The gradient
    the optimizer sees is the same up to bf16 accumulation."""
    acc = bench_alone.result["scale"]["comm"]["accumulation"]
    units, n = acc["fsdp_units"], acc["microbatches"]
    assert n == 4 and units > 10  # the tiny U-Net's ResNet and transformer blocks, and the root
    grad_op = acc["SHARD_GRAD_OP"]
    assert grad_op["no_sync"] | {"bytes": 0} == {"all_gathers": units, "reduce_scatters": units, "bytes": 0}
    assert grad_op["sync_every_microbatch"]["all_gathers"] == n * units  # the positive control
    assert grad_op["sync_every_microbatch"]["reduce_scatters"] == n * units
    assert grad_op["sync_every_microbatch"]["bytes"] == pytest.approx(
        n * grad_op["no_sync"]["bytes"], rel=1e-3
    )
    full = acc["FULL_SHARD"]
    assert full["no_sync"]["reduce_scatters"] == units
    assert full["sync_every_microbatch"]["reduce_scatters"] == n * units
    # re-gathered in each forward and each backward (the root keeps its parameters between the two)
    assert (
        full["no_sync"]["all_gathers"] == full["sync_every_microbatch"]["all_gathers"] == n * (2 * units - 1)
    )
    # bf16 params (the recipe's amp_bf16): no_sync sums the microbatches' bf16 gradients in bf16
    for strategy in ("SHARD_GRAD_OP", "FULL_SHARD"):
        assert acc[strategy]["grad_max_rel_diff"] < ACCUMULATION_GRAD_TOLERANCE, acc[strategy]
    assert f"SHARD_GRAD_OP {units}/{units} (every microbatch: {n * units}/{n * units})" in (
        accumulation_finding(acc)
    )
