"""Measured planner inputs: a `make bench` JSON (throughput, encode rate), an encode manifest."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared import storage
from shared.estimate.config import EstimateConfig
from shared.estimate.gpus import GPU_TABLE, MANIFEST_FILE, EstimateError, gpu_type_for_device

# ------------------------------------------------------------------------------------- measured inputs


@dataclass(frozen=True)
class Measured:
    """The numbers the estimate runs on, after reading the bench JSON and encode manifest (if given)."""

    throughput: dict[int, float]  # training images/s per GPU by resolution, on `measured_on`
    measured_on: str
    reference_gpus: int
    encode_images_per_s_per_gpu: float
    bytes_per_sample: dict[int, float]
    kept_share: dict[int, float]  # share of read samples each resolution keeps (from a manifest; else {})
    notes: tuple[str, ...] = ()


def _read_json(uri: str, what: str, fix: str) -> dict[str, Any]:
    try:
        obj = storage.read_json(uri)
    except (OSError, ValueError) as err:
        raise EstimateError(f"cannot read {what} {uri!r}: {err}; {fix}") from err
    if not isinstance(obj, dict):
        raise EstimateError(f"{what} {uri!r} must hold a JSON object, not {type(obj).__name__}; {fix}")
    return obj


def _rate(entry: Any, where: str) -> float:
    value = entry.get("images_per_s_per_device") if isinstance(entry, dict) else None
    if not isinstance(value, (int, float)) or value <= 0:
        raise EstimateError(f"{where}: expected {{'images_per_s_per_device': <number > 0>}}, got {entry!r}")
    return float(value)


def _encode_rate(entry: Any, where: str) -> float:
    """One rate, or per-resolution rates whose per-image times add up (each sample is encoded at each)."""
    if isinstance(entry, dict) and "images_per_s_per_device" not in entry:
        seconds = sum(1.0 / _rate(v, f"{where}.{k}") for k, v in entry.items())
        return 1.0 / seconds if seconds else 0.0
    return _rate(entry, where)


def _resolution(key: Any, where: str) -> int:
    if not str(key).strip().isdigit():
        raise EstimateError(f'{where}: keys must be resolutions in px (e.g. "256"), got {key!r}')
    return int(key)


def read_bench(uri: str) -> dict[str, Any]:
    """Parse a `make bench` JSON into {train: {res: rate}, device, gpu_type, num_devices, encode}."""
    fix = "point throughput_from at the JSON `make bench` wrote (schema: the shared/estimate docstring)"
    obj = _read_json(uri, "bench result", fix)
    train = obj.get("train")
    if not isinstance(train, dict) or not train:
        raise EstimateError(f"bench result {uri} has no `train` section keyed by resolution; {fix}")
    device = str(obj.get("device") or "")
    where = f"bench result {uri}"
    return {
        "train": {_resolution(r, where): _rate(e, f"{where}: train.{r}") for r, e in train.items()},
        # images per device in the timed step (older bench JSONs do not say)
        "batch": {
            _resolution(r, where): int(e["batch_size"])
            for r, e in train.items()
            if isinstance(e, dict) and isinstance(e.get("batch_size"), int)
        },
        "as_recipe": _as_recipe(obj, where),
        "device": device,
        "stopped_in": obj.get("running") if obj.get("complete") is False else None,
        "gpu_type": gpu_type_for_device(device) if device else None,
        "num_devices": int(obj["num_devices"]) if obj.get("num_devices") else None,
        "encode": _encode_rate(obj["encode"], f"{where}: encode") if obj.get("encode") else None,
    }


def _as_recipe(obj: dict[str, Any], where: str) -> dict[int, tuple[float, int]]:
    """{resolution: (images/s, microbatch)} of the bench's recipe as a run of it trains (its FSDP, its
    microbatch; `trainer.as_recipe`), when the bench ran it."""
    entries = (obj.get("trainer") or {}).get("as_recipe")
    if not isinstance(entries, dict):
        return {}
    return {
        _resolution(res, where): (_rate(e, f"{where}: trainer.as_recipe.{res}"), int(e["batch_size"]))
        for res, e in entries.items()
    }


def _prefer_as_recipe(
    cfg: EstimateConfig, bench: dict[str, Any], throughput: dict[int, float]
) -> tuple[dict[int, int], list[str]]:
    """Where the bench ran the recipe as a run trains it at the plan's microbatch, that rate replaces the
    bare step's (timed unwrapped at a larger batch): the batch per GPU, FSDP and the conv kernels' layout
    are in it, communication is not. Returns the batch each rate was measured at, and what was replaced."""
    batches, notes = dict(bench["batch"]), []
    planned = {int(r): b for r, b in cfg.memory.microbatch.items()}
    for res, (rate, batch) in bench["as_recipe"].items():
        if res in throughput and planned.get(res) == batch:
            notes.append(
                f"{res} px: throughput of the recipe as run (FSDP, microbatch {batch}, one GPU): "
                f"{rate:,.1f} img/s, not the bare step's {throughput[res]:,.1f} at batch {batches.get(res)}"
            )
            notes += _small_batch_note(res, rate, batch, throughput[res], batches.get(res))
            throughput[res], batches[res] = rate, batch
    return batches, notes


# The recipe as run below this share of the bare step's images/s per GPU: its per-GPU batch, not the U-Net,
# sets the rate (the sixth H200 run: 8 images per GPU ran 27 img/s at 256 px against 583 at 128, the
# device mostly waiting for the host to launch each FSDP unit's kernels)
SMALL_BATCH_SHARE = 0.5


def _small_batch_note(
    res: int, rate: float, batch: int, step_rate: float, step_batch: int | None
) -> list[str]:
    """What the plan's microbatch costs against the bench's batch, where it costs much."""
    if not step_batch or step_batch <= batch or rate >= SMALL_BATCH_SHARE * step_rate:
        return []
    return [
        f"{res} px: {batch} images per GPU run at {rate / step_rate:.0%} of the images/s per GPU of "
        f"{step_batch} ({rate:,.1f} against {step_rate:,.1f}): each image costs {step_rate / rate:.1f}x "
        f"the GPU-hours (before communication). The memory line says what fits: fewer GPUs with a larger "
        "device_microbatch_size for this global batch, or a larger global_batch_size (a new recipe)"
    ]


def read_manifest_sizes(uri: str) -> tuple[dict[int, float], dict[int, float]]:
    """Bytes per sample and kept share per resolution from an encode manifest (root or manifest.json)."""
    path = uri if uri.endswith(".json") else storage.join(uri, MANIFEST_FILE)
    fix = "point storage.manifest at the output.uri of a finished `make encode` run (or its manifest.json)"
    obj = _read_json(path, "encode manifest", fix)
    resolutions, counts = obj.get("resolutions"), obj.get("num_samples") or {}
    if not isinstance(resolutions, dict) or not resolutions:
        raise EstimateError(f"encode manifest {path} has no `resolutions` section; {fix}")
    samples_read = obj.get("samples_read") or 0
    bytes_per_sample, kept = {}, {}
    for key, info in resolutions.items():
        res = _resolution(key, f"encode manifest {path}: resolutions")
        n = counts.get(str(key), info.get("num_samples", 0))
        if n > 0 and info.get("bytes", 0) > 0:
            bytes_per_sample[res] = info["bytes"] / n
            kept[res] = n / samples_read if samples_read > 0 else 1.0
    if not bytes_per_sample:
        raise EstimateError(f"encode manifest {path} holds no sized samples at any resolution; {fix}")
    return bytes_per_sample, kept


def _bench_reference(devices: int | None, fit_from: int, notes: list[str]) -> int:
    """The GPU count scaling starts from: the bench's, but not below the count the per-doubling
    efficiency was fitted from (scaling.reference_gpus, one 8-GPU node for the published runs). Applied
    from 1 GPU, that fit charged its cross-node loss to each doubling inside the node too (0.9^3 = 0.73 at
    8 GPUs, 37% more GPU-hours at 128); within a node the step's all-reduce rides NVLink."""
    if not devices:
        return fit_from
    if devices < fit_from:
        notes.append(
            f"bench on {devices} GPU{'s' if devices > 1 else ''}: {devices} -> {fit_from} GPUs taken as "
            f"linear (the scaling efficiency is per doubling beyond {fit_from}, fitted across nodes); a "
            f"bench on {fit_from} GPUs measures it"
        )
    return max(devices, fit_from)


def resolve_inputs(cfg: EstimateConfig) -> Measured:
    """Config numbers, replaced by the bench JSON and encode manifest where those are given."""
    notes: list[str] = []
    throughput = {int(k): v for k, v in cfg.throughput.per_gpu.items()}
    measured_on, reference = cfg.measured_on, cfg.scaling.reference_gpus
    encode_rate = cfg.encode.images_per_s_per_gpu
    if cfg.throughput_from:
        bench = read_bench(cfg.throughput_from)
        throughput = bench["train"]
        batches, replaced = _prefer_as_recipe(cfg, bench, throughput)
        measured_on = bench["gpu_type"] or measured_on
        reference = _bench_reference(bench["num_devices"], reference, notes)
        encode_rate = bench["encode"] or encode_rate
        notes.append(f"throughput from {cfg.throughput_from} ({bench['device'] or 'device not recorded'})")
        if bench["device"] and not bench["gpu_type"]:
            notes.append(f"WARNING: bench device {bench['device']!r} is unknown; taken as {measured_on}")
        notes += replaced + _batch_mismatch_notes(cfg, batches)
        if bench["stopped_in"]:
            notes.append(f"bench stopped in its {bench['stopped_in']} section; its step numbers are whole")
    bytes_per_sample = {int(k): v for k, v in cfg.storage.bytes_per_sample.items()}
    kept: dict[int, float] = {}
    if cfg.storage.manifest:
        bytes_per_sample, kept = read_manifest_sizes(cfg.storage.manifest)
        notes.append(f"bytes/sample from {cfg.storage.manifest}")
    _check_throughput_covers_schedule(cfg, throughput)
    _check_encode_rate(cfg, encode_rate)
    if measured_on != cfg.gpu.type:
        notes.append(_device_mismatch_note(cfg, measured_on))
    return Measured(throughput, measured_on, reference, encode_rate, bytes_per_sample, kept, tuple(notes))


def _check_throughput_covers_schedule(cfg: EstimateConfig, throughput: Mapping[int, float]) -> None:
    missing = sorted({p.resolution for p in cfg.schedule} - set(throughput))
    if missing:
        have = ", ".join(str(r) for r in sorted(throughput)) or "none"
        raise EstimateError(
            f"no training throughput for {', '.join(map(str, missing))} px (have: {have}); set "
            f"throughput.per_gpu.{missing[0]}=<images/s/GPU> or throughput_from=<make bench JSON>"
        )


def _check_encode_rate(cfg: EstimateConfig, rate: float) -> None:
    if cfg.encode.samples and rate <= 0:
        raise EstimateError(
            f"encode.samples={cfg.encode.samples} but no encode throughput; set "
            "encode.images_per_s_per_gpu=<images/s/GPU> (or encode.samples=0 to leave encode out)"
        )


def _device_mismatch_note(cfg: EstimateConfig, measured_on: str) -> str:
    if cfg.throughput.scale_by_peak_flops:
        ratio = GPU_TABLE[cfg.gpu.type].peak_bf16_tflops / GPU_TABLE[measured_on].peak_bf16_tflops
        return f"throughput measured on {measured_on}, scaled x{ratio:.2f} by peak bf16 TFLOP/s (optimistic)"
    return (
        f"WARNING: throughput measured on {measured_on} but planning {cfg.gpu.type}; run `make bench` on "
        f"{cfg.gpu.type} or set throughput.scale_by_peak_flops=true for an optimistic bound"
    )


def _batch_mismatch_notes(cfg: EstimateConfig, measured: Mapping[int, int]) -> list[str]:
    """A throughput timed at another batch per GPU than the plan's microbatch does not carry over: a
    smaller batch runs smaller kernels for the same per-step host work and launches (SD2 at 256 px, batch
    8: 32x32 latents), so its images/s per GPU is lower, by an amount only a GPU measures."""
    notes = []
    planned = {int(r): b for r, b in cfg.memory.microbatch.items()}
    for res in sorted({p.resolution for p in cfg.schedule}):
        bench_batch, plan_batch = measured.get(res), planned.get(res)
        if bench_batch and plan_batch and bench_batch != plan_batch:
            notes.append(
                f"WARNING: {res} px throughput was measured at {bench_batch} images per GPU, this plan runs "
                f"microbatches of {plan_batch} (memory.microbatch): measure that batch (`make bench "
                f"BENCH=full ARGS='loader.resolution={res}'` runs the recipe as it trains, at its own "
                f"microbatch: trainer.as_recipe) or run the global batch on fewer GPUs"
            )
    return notes
