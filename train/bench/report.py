"""What the bench numbers say (findings) and how they are written: markdown tables and JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from train.bench.anatomy.buckets import bucket_findings, bucket_rows
from train.bench.anatomy.report import anatomy_findings, step_findings, vae_findings
from train.bench.trainer.report import trainer_findings, trainer_rows

JSON_NAME = "bench.json"
MARKDOWN_NAME = "bench.md"
# Below these the findings call a part of the product out as not close to its limit.
LOADER_HEADROOM = 2.0  # loader images/s over train-step images/s
NEAR_LIMIT = 0.8  # share of a bound (encode pipeline vs its slowest stage, offline speedup vs ideal)
# the encode device idle between model calls for this share of its time: the host holds the pipeline
# (on CPU the "device" is the host, and the flag says only that the models are not the whole run)
DEVICE_IDLE_SHARE = 0.1
HOST_WORK_SHARE = 0.05  # host-side work on a device's critical path (Objective.prepare, VAE input prep)


def _pct(x: float, digits: int = 0) -> str:
    return f"{100 * x:.{digits}f}%"


def train_findings(train: dict[str, Any]) -> list[str]:
    notes = []
    for res, t in train.items():
        if "offline_speedup" in t:
            speedup, ideal = t["offline_speedup"], t["ideal_offline_speedup"]
            notes.append(
                f"{res} px: precomputing speeds the step up {speedup:.2f}x (ideal from FLOPs {ideal:.2f}x)"
            )
        notes += step_findings(res, t)
        if "first_step_s" in t:  # a compiled recipe compiles the U-Net's forward and backward in it
            notes.append(
                f"{res} px: first step {t['first_step_s']:.1f} s (compile and cuDNN autotuning included), "
                f"then {t['step']['median_s']:.3f} s a step"
            )
        if t["prepare_share_of_step"] > HOST_WORK_SHARE:
            notes.append(
                f"{res} px: Objective.prepare (per-sample noise draws on the host) takes "
                f"{_pct(t['prepare_share_of_step'])} of the step"
            )
    return notes


LOADER_VS_STREAMING_TARGET = 0.9  # train's loader over plain StreamingDataset of the same shards (issue 24)


def streaming_peer_finding(peer: dict[str, Any]) -> str:
    parts = [
        f"{run['streams']} stream(s) {run['vs_plain_streaming']:.2f}x ({run['images_per_s']:,.0f} vs "
        f"{run['plain_streaming_images_per_s']:,.0f} img/s)"
        for run in peer.values()
    ]
    low = [run for run in peer.values() if run["vs_plain_streaming"] < LOADER_VS_STREAMING_TARGET]
    verdict = f" - below the {LOADER_VS_STREAMING_TARGET}x target" if low else ""
    return f"train loader vs plain StreamingDataset of the same shards: {'; '.join(parts)}{verdict}"


def loader_findings(loader: dict[str, Any], step_rate: float) -> list[str]:
    headroom = loader["images_per_s"] / step_rate
    starve = " - too little headroom: the loader can starve the step" if headroom < LOADER_HEADROOM else ""
    per_sample_us = 1e6 * max(loader["num_workers"], 1) / loader["images_per_s"]
    read_share = loader["bytes_per_s"] / loader["raw_read_bytes_per_s"]
    return [
        f"loader {loader['images_per_s']:,.0f} img/s = {headroom:.1f}x the train step{starve}",
        f"loader costs {per_sample_us:,.0f} us of one worker per sample and moves "
        f"{loader['bytes_per_s'] / 1e6:,.1f} MB/s, {_pct(read_share)} of a raw read of the same shards: "
        "per-sample and per-batch work, not reading, sets its rate",
    ]


def encode_findings(encode: dict[str, Any]) -> list[str]:
    flag = " - below its bound" if encode["share_of_bound"] < NEAR_LIMIT else ""
    notes = [
        f"encode pipeline {encode['images_per_s_per_device']:,.1f} samples/s = "
        f"{_pct(encode['share_of_bound'])} of its bound {encode['bound_samples_per_s']:,.1f} and "
        f"{_pct(encode['share_of_slowest_stage'])} of its slowest stage ({encode['slowest_stage']}){flag}"
    ]
    if "steady_samples_per_s" in encode:
        notes.append(
            f"encode pipeline once running (first model call to last, worker start-up left out): "
            f"{encode['steady_samples_per_s']:,.1f} samples/s = {_pct(encode['steady_share_of_bound'])} of "
            "its bound"
        )
    if shares := encode.get("main_thread_share"):
        spent = ", ".join(f"{name.replace('_', ' ')} {_pct(share)}" for name, share in shares.items())
        if parts := encode.get("main_thread_launch_share"):
            launch = ", ".join(f"{name.replace('_', ' ')} {_pct(share)}" for name, share in parts.items())
            spent += f" (launch: {launch})"
        notes.append(f"encode main thread: {spent} of the pipeline's time")
    if device := encode.get("device_s"):
        idle = encode["device_idle_share"]
        flag = " - the host is the bound" if idle > DEVICE_IDLE_SHARE else ""
        notes.append(
            f"encode device: busy {device['busy']:.2f} s, idle {_pct(idle)} of its time between model calls "
            f"(waiting for the host); {encode['device_busy_samples_per_s']:,.1f} "
            f"samples/s while busy against {encode['models_serial_samples_per_s']:,.1f} for the models "
            f"alone{flag}"
        )
    if "vae_input_shapes" in encode:
        notes.append(vae_shapes_finding(encode))
    if encode["vae_input_share_of_vae"] > HOST_WORK_SHARE:
        notes.append(
            f"encode VAE stage: {_pct(encode['vae_input_share_of_vae'])} of it is host-side pixel conversion "
            "(uint8 -> float32 NCHW in the main process, before the copy to the device)"
        )
    return notes


def vae_shapes_finding(encode: dict[str, Any]) -> str:
    """The first H200 pipeline ran at 46% of its bound with the device busy 97%: cuDNN autotuning left on by
    the train sections re-timed the eager VAE's convolutions for every batch length a partition left."""
    shapes, sizes = encode["vae_input_shapes"], len(encode["resolutions"])
    how = "compiled, short batches padded" if encode["encoder_compiled"] else "eager"
    tuned = encode["cudnn_autotuning"]
    flag = f" - {shapes - sizes} more than its image sizes, each re-tuned" if tuned and shapes > sizes else ""
    how += f", cuDNN autotuning {'on' if tuned else 'off'}"
    return f"encode VAE: {shapes} input shapes in a pipeline run ({how}){flag}"


def scale_findings(scale: dict[str, Any]) -> list[str]:
    notes = []
    if "python_side_share" in scale:
        share, target = scale["python_side_share"], scale["python_side_share_target"]
        syncs = scale["host_syncs_per_step"]
        flag = " - above target" if share > target else ""
        notes.append(
            f"scale: {_pct(share, 1)} of a step outside the U-Net and optimizer "
            f"(target < {_pct(target)}){flag}; host syncs per step: train job {syncs['train']:g}, "
            f"Composer {syncs['composer']:g}"
        )
    if (s3 := scale.get("s3")) and "skipped" not in s3:
        per_step = s3["requests_per_step_outside_checkpoints"]
        flag = " - must be 0: a synchronous round trip per step holds up every rank" if per_step else ""
        notes.append(f"scale: {per_step} S3 requests per step outside checkpoint steps{flag}")
    if comm := scale.get("comm"):
        flag = "" if comm["ema_update_bytes"] == 0 else " - must be 0: the EMA gathers the model per update"
        agree = "agrees" if comm["planner_agrees"] else "DISAGREES - fix shared/estimate/cluster.py"
        notes.append(
            f"scale: the EMA update moves {comm['ema_update_bytes']:,} bytes under FSDP{flag}; an optimizer "
            f"step's collectives per parameter {agree} with the dry-run planner's formula"
        )
        if accumulation := comm.get("accumulation"):
            notes.append(accumulation_finding(accumulation))
    return notes


def accumulation_finding(acc: dict[str, Any]) -> str:
    """All-gathers / reduce-scatters per optimizer step of several microbatches, with the train job's
    FSDP no_sync and as Composer's loop runs it (every microbatch)."""
    parts = []
    for strategy in ("SHARD_GRAD_OP", "FULL_SHARD"):
        ours, every = acc[strategy]["no_sync"], acc[strategy]["sync_every_microbatch"]
        parts.append(
            f"{strategy} {ours['all_gathers']}/{ours['reduce_scatters']} "
            f"(every microbatch: {every['all_gathers']}/{every['reduce_scatters']})"
        )
    return (
        f"scale: {acc['microbatches']} microbatches per step over {acc['fsdp_units']} FSDP units, "
        "all-gathers/reduce-scatters per step: " + "; ".join(parts)
    )


def findings(result: dict[str, Any]) -> list[str]:
    """One line per place the numbers say something (speedup vs ideal, MFU, headroom, overheads)."""
    notes = train_findings(result["train"])
    if (pre := result.get("precompile")) and "skipped" not in pre:
        failed = f"; failed: {', '.join(pre['failed'])} (compiled by their sections)" if pre["failed"] else ""
        notes.append(
            f"precompile: {len(pre['units'])} compiled steps built side by side, {pre['workers']} at a time, "
            f"in {pre['seconds']:.0f} s, into the compile cache the sections read (see first_step_s){failed}"
        )
    if peer := result.get("loader_vs_streaming"):
        notes.append(streaming_peer_finding(peer))
    if loader := result.get("loader"):
        notes += loader_findings(
            loader, result["train"][str(loader["resolution"])]["images_per_s_per_device"]
        )
    if trainer := result.get("trainer"):
        notes += trainer_findings(trainer, result["train"])
    if scale := result.get("scale"):
        notes += scale_findings(scale)
    if encode := result.get("encode"):
        notes += encode_findings(encode) + vae_findings(encode)
    if anatomy := result.get("anatomy"):
        notes += anatomy_findings(anatomy)
    if buckets := result.get("buckets"):
        notes += bucket_findings(buckets)
    notes += [
        f"{res} px: text.store=tokens (text tower in the step) takes {t['ratio']:.3f}x the step on stored "
        f"embeddings (ideal from FLOPs {t['flop_ideal_ratio']:.3f}x)"
        for res, t in result.get("text_store", {}).items()
    ]
    return notes


# ---------------------------------------------------------------------------------------------- outputs
def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown table lines; the first column left-aligned, the rest right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _train_table(result: dict[str, Any]) -> list[str]:
    header = [
        "res",
        "batch",
        "img/s offline",
        "img/s online",
        "speedup",
        "ideal",
        "U-Net step GFLOP/img",
        "MFU",
    ]
    rows = []
    for res, t in result["train"].items():
        online = t.get("online", {}).get("images_per_s_per_device")
        rows.append(
            [
                res,
                str(t["batch_size"]),
                _fmt(t["images_per_s_per_device"]),
                _fmt(online),
                _fmt(t.get("offline_speedup")),
                _fmt(t["ideal_offline_speedup"]),
                _fmt(result["flops"][res]["unet_train_step"] / 1e9, 1),
                "n/a" if t["mfu"] is None else f"{100 * t['mfu']:.1f}%",
            ]
        )
    return _table(header, rows)


def _pipeline_table(result: dict[str, Any]) -> list[str]:
    rows = []
    if loader := result.get("loader"):
        step = result["train"][str(loader["resolution"])]["images_per_s_per_device"]
        raw = loader["raw_read_bytes_per_s"] / 1e6
        rows.append(
            [
                f"loader ({loader['resolution']} px)",
                f"{_fmt(loader['images_per_s'], 1)} img/s",
                f"step {_fmt(step)} img/s",
            ]
        )
        rows.append(
            ["loader bytes", f"{_fmt(loader['bytes_per_s'] / 1e6, 1)} MB/s", f"raw read {_fmt(raw, 1)} MB/s"]
        )
    if trainer := result.get("trainer"):
        rows += trainer_rows(trainer, result["train"])
    if buckets := result.get("buckets"):
        square = result["train"].get(str(buckets["resolution"]), {}).get("images_per_s_per_device")
        rows += bucket_rows(buckets, square)
    if encode := result.get("encode"):
        stages = ", ".join(f"{k} {_fmt(v, 1)}" for k, v in encode["stages_samples_per_s"].items())
        rate = f"{_fmt(encode['images_per_s_per_device'], 1)} samples/s"
        rows.append(
            ["encode pipeline", rate, f"alone: {stages}; bound {_fmt(encode['bound_samples_per_s'], 1)}"]
        )
    return _table(["part", "measured", "compared with"], rows) if rows else []


def _s3_rows(s3: dict[str, Any]) -> list[list[str]]:
    if "skipped" in s3:
        return [["S3 requests per step outside checkpoints", "skipped", s3["skipped"]]]
    at_checkpoints = ", ".join(f"{op} {n}" for op, n in s3["by_operation_checkpoint_steps"].items())
    return [
        [
            "S3 requests per step outside checkpoints",
            str(s3["requests_per_step_outside_checkpoints"]),
            f"target 0; {s3['batches']} steps, checkpoint every {s3['checkpoint_interval_batches']}: "
            f"{at_checkpoints or 'none'} in the steps after checkpoints",
        ]
    ]


def _comm_rows(comm: dict[str, Any]) -> list[list[str]]:
    settings = comm["step_settings"]
    calls = ", ".join(f"{name} {n}" for name, n in comm["step_calls"].items())
    measured, planned = comm["step_bytes_per_param"], comm["planner_bytes_per_param"]
    sd2 = comm["sd2_gb_per_rank_per_step"]
    rows = [
        [
            "EMA update bytes per step (FSDP, 2 ranks)",
            f"{comm['ema_update_bytes']:,}",
            f"target 0; one full-model gather moves {comm['full_model_gather_bytes']:,}",
        ],
        [
            f"collectives per optimizer step ({settings['recipe']} on {settings['world_size']} GPUs: "
            f"{settings['strategy']}, microbatch {settings['microbatch']}, "
            f"accumulation {settings['grad_accum']})",
            calls,
            f"{comm['step_bytes']:,} bytes on 2 ranks, {comm['step_model_params']:,} params",
        ],
        [
            "bytes per parameter per step: all-gather / reduce-scatter",
            f"{measured['all_gather']:.2f} / {measured['reduce_scatter']:.2f}",
            f"planner {planned['all_gather']:.2f} / {planned['reduce_scatter']:.2f}; SD2-base per rank "
            f"{sd2['all_gather']:.3f} + {sd2['reduce_scatter']:.3f} GB",
        ],
    ]
    acc = comm.get("accumulation") or {}
    for strategy in ("SHARD_GRAD_OP", "FULL_SHARD") if acc else ():
        ours, every = acc[strategy]["no_sync"], acc[strategy]["sync_every_microbatch"]
        rows.append(
            [
                f"all-gathers / reduce-scatters per step, {acc['microbatches']} microbatches, {strategy}",
                f"{ours['all_gathers']} / {ours['reduce_scatters']}",
                f"without no_sync {every['all_gathers']} / {every['reduce_scatters']}; "
                f"{acc['fsdp_units']} FSDP units",
            ]
        )
    ckpt = comm["checkpoint"]
    for fmt in ("full", "sharded"):
        per_rank = " / ".join(f"{b / 1e6:.2f}" for b in ckpt[fmt]["bytes_per_rank"])
        rows.append(
            [
                f"checkpoint {fmt} ({ckpt['ranks']} ranks, {ckpt['params']:,} params)",
                f"{_fmt(1000 * ckpt[fmt]['seconds_per_save'], 1)} ms per save",
                f"MB written per rank {per_rank}",
            ]
        )
    return rows


def _scale_table(result: dict[str, Any]) -> list[str]:
    scale = result.get("scale", {})
    rows = []
    if "python_side_share" in scale:
        rows.append(
            [
                "python-side share of a step",
                _pct(scale["python_side_share"], 1),  # one decimal: 4.7% is not "5%, target < 5%"
                f"target < {_pct(scale['python_side_share_target'])}",
            ]
        )
    if s3 := scale.get("s3"):
        rows += _s3_rows(s3)
    if comm := scale.get("comm"):
        rows += _comm_rows(comm)
    return _table(["scale counter", "measured", "target / compared with"], rows) if rows else []


def render_markdown(result: dict[str, Any]) -> str:
    """The short tables: the step per resolution, then loader / trainer / encode, then the findings."""
    overrides = result.get("recipe_overrides") or []
    named = f", recipe {result.get('recipe')} with {' '.join(overrides)}" if overrides else ""
    lines = [f"# Bench: {result['preset']} on {result['device']} ({result['precision']}{named})", ""]
    lines += [*_train_table(result), ""]
    if pipeline := _pipeline_table(result):
        lines += [*pipeline, ""]
    if scale := _scale_table(result):
        lines += [*scale, ""]
    lines += [f"- {note}" for note in result["findings"]]
    return "\n".join(lines) + "\n"


def write_json(result: dict[str, Any], out_dir: str | Path) -> Path:
    """`<out_dir>/bench.json`, replaced in one rename: a reader (the GPU check, make estimate) never sees
    half a file, whether this is the final result or the sections so far (train/bench/run.py)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{JSON_NAME}.partial"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    return tmp.replace(out / JSON_NAME)


def write_outputs(result: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    paths = {"json": write_json(result, out_dir), "md": Path(out_dir) / MARKDOWN_NAME}
    paths["md"].write_text(render_markdown(result))
    return paths
