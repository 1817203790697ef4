"""The scale section's collective counters (issue 11), from one spawned job of 2 gloo CPU ranks.

Composer's FSDP wrapper needs CUDA, so each rank wraps the model the way Composer 0.32's
`prepare_fsdp_module` does (every child of the ComposerModel is its own FSDP root, auto-wrapped by that
child's `fsdp_wrap_fn` if it has one), with PyTorch's FSDP on CPU and the FSDP settings the trainer hands
Composer for the shipped SD2 recipe (`train.loop.trainer.parallelism_config`: SHARD_GRAD_OP, original
parameters, bf16 params and fp32 gradient reduction through Composer's own `get_mixed_precision`). The model
is the tiny preset's U-Net (shapes do not change which collectives run, only their size), and the batch
settings are the recipe's at its target cluster size (jobs/train/sd2-base-256.yaml on 256 GPUs: 8 per rank
in 1 microbatch). Measured, with `train.loop.comm_counter.count_collectives`:

- ema:  bytes moved by one EMA update under FSDP (must be 0); beside it what gathering the full model
        moves (what an unsharded EMA paid per update), which also proves the counter sees FSDP's traffic;
- step: collective calls and bytes per optimizer step, by phase (forward, backward, clipping, optimizer),
        converted to bytes of the full tensor per parameter, the unit `shared/estimate/cluster.py`'s
        formulas use (an all-gather or reduce-scatter passes 1 + 1/W of the full tensor through the call);
- checkpoint: bytes written per rank and seconds per save, full vs sharded (train/bench/ckpt.py's model and
        Composer save path).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from composer.core import Event
from composer.distributed.mosaic_parallelism import get_mixed_precision
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp.wrap import CustomPolicy

from shared.batching import derive_batching
from shared.config import load_config
from shared.estimate.cluster import DTYPE_BYTES, PRESET_PARAMS, step_comm
from shared.presets import get_preset
from shared.runtime.device import resolve_precision
from train.bench.ckpt import bytes_written_by_rank, composer_state, init_gloo, save_with_composer, trained_net
from train.config import TrainConfig
from train.ema.algorithm import build_ema
from train.loop.comm_counter import CollectiveCount, count_collectives
from train.loop.step import accumulation_sync
from train.loop.trainer import parallelism_config
from train.model.assemble import assemble_model
from train.model.diffusion import DenoiseInput, DiffusionModel

SCALE_RANKS = 2
SHIPPED_RECIPE = "sd2-base-256"  # the recipe whose batch and FSDP settings are counted
SHIPPED_WORLD_SIZE = 256  # the cluster it is sized for: 2048 / 256 = 8 per rank
MEASURED_PRESET = "tiny"
MEASURED_RESOLUTION = 64
MEASURED_MICROBATCH = 2  # samples per microbatch on the CPU ranks: the count does not depend on it
STEP_PHASES = ("forward", "backward", "clip", "optimizer")
ACCUMULATION = 4  # microbatches per optimizer step in the accumulation count (the 8-GPU SD2 recipe: 32)
RESULT_NAME = "scale-collectives.json"
PLANNER_TOLERANCE = 0.01  # measured vs formula bytes per parameter: FSDP pads each flat parameter to W
GB = 1e9


@dataclass(frozen=True)
class CommSettings:
    """The recipe's FSDP and batch settings at its target world size."""

    recipe: str
    world_size: int
    strategy: str
    precision: str  # what the recipe runs on GPU (its `precision: auto`)
    mixed_precision: dict[str, str]  # Composer's `parallelism_config.fsdp.mixed_precision` from the trainer
    per_rank_batch: int
    microbatch: int
    grad_accum: int
    grad_clip_norm: float | None


def shipped_settings(recipe: str = SHIPPED_RECIPE, world_size: int = SHIPPED_WORLD_SIZE) -> CommSettings:
    cfg = load_config(TrainConfig, recipe, [], kind="train").for_world(world_size)
    batching = derive_batching(cfg.global_batch_size, world_size, cfg.device_microbatch_size)
    precision = resolve_precision(cfg.precision, "gpu")
    fsdp = parallelism_config(fsdp_context(cfg, precision, world_size))["fsdp"]  # type: ignore[index]
    return CommSettings(
        recipe, world_size, fsdp["sharding_strategy"], precision, dict(fsdp["mixed_precision"]),
        batching.per_rank_batch, batching.microbatch, batching.grad_accum, cfg.optimizer.grad_clip_norm,
    )  # fmt: skip


def fsdp_context(cfg: TrainConfig, precision: str, world_size: int) -> Any:
    """What `parallelism_config` reads of a run context: the config, precision and world size."""
    return SimpleNamespace(cfg=cfg, precision=precision, batching=SimpleNamespace(world_size=world_size))


# --------------------------------------------------------------------------------------------- wrapping
def composer_wrap_policy(child: nn.Module) -> CustomPolicy:
    """Composer 0.32's auto-wrap rule for one child of the ComposerModel: a module's `_fsdp_wrap`, else the
    child's own `fsdp_wrap_fn` (Composer looks it up on the child, not on the ComposerModel)."""

    def wrap(module: nn.Module) -> bool:
        if hasattr(module, "_fsdp_wrap"):
            return bool(module._fsdp_wrap)
        rule = getattr(child, "fsdp_wrap_fn", None)
        return bool(rule(module)) if callable(rule) else False

    return CustomPolicy(wrap)


def wrap_like_composer(model: DiffusionModel, settings: CommSettings) -> None:
    """Each child with parameters becomes an FSDP root, as Composer's FSDP preparation does, on CPU."""
    mixed_precision = get_mixed_precision(settings.precision, settings.mixed_precision)[0]
    for name, child in list(model.named_children()):
        if not any(True for _ in child.parameters()):
            continue
        wrapped = FullyShardedDataParallel(
            child, sharding_strategy=ShardingStrategy[settings.strategy], mixed_precision=mixed_precision,
            auto_wrap_policy=composer_wrap_policy(child), device_id=torch.device("cpu"), use_orig_params=True,
        )  # fmt: skip
        setattr(model, name, wrapped)


def tiny_model() -> DiffusionModel:
    cfg = load_config(TrainConfig, "tiny", [f"model.preset={MEASURED_PRESET}"], kind="train")
    empty = torch.zeros(get_preset(MEASURED_PRESET).text_shape())
    return assemble_model(cfg, "cpu", get_preset(MEASURED_PRESET).scale_factor, empty)


def microbatch_input(batch: int) -> tuple[DenoiseInput, torch.Tensor]:
    preset = get_preset(MEASURED_PRESET)
    latents = torch.randn(batch, *preset.latent_shape(MEASURED_RESOLUTION))
    inputs = DenoiseInput(latents, torch.randint(0, 1000, (batch,)), torch.randn(batch, *preset.text_shape()))
    return inputs, torch.randn_like(latents)


# -------------------------------------------------------------------------------------------- counting
def _as_json(count: CollectiveCount) -> dict[str, Any]:
    return {"calls": dict(sorted(count.calls.items())), "bytes": count.bytes}


def count_optimizer_step(
    model: DiffusionModel, optimizer: torch.optim.Optimizer, settings: CommSettings, no_sync: bool = True
) -> dict[str, dict[str, Any]]:
    """One optimizer step as the train job runs it under FSDP: `grad_accum` microbatches, each a forward and
    a backward inside `accumulation_sync` (the trainer's FSDP no_sync; `no_sync=False`: Composer's own loop,
    which syncs every microbatch), clipping, the optimizer; counted by phase."""
    counts = {phase: CollectiveCount() for phase in STEP_PHASES}
    for index in range(settings.grad_accum):
        inputs, target = microbatch_input(MEASURED_MICROBATCH)
        final = not no_sync or index + 1 == settings.grad_accum
        with accumulation_sync(model, final), count_collectives() as forward:
            loss = (model(inputs).float() - target).square().mean() / settings.grad_accum
        with accumulation_sync(model, final), count_collectives() as backward:
            loss.backward()
        _add(counts["forward"], forward)
        _add(counts["backward"], backward)
    with count_collectives() as counts["clip"]:
        if settings.grad_clip_norm:
            model.unet.clip_grad_norm_(settings.grad_clip_norm)  # Composer's clipping under FSDP
    with count_collectives() as counts["optimizer"]:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {phase: _as_json(count) for phase, count in counts.items()}


def count_accumulation(settings: CommSettings) -> dict[str, Any]:
    """Collective calls per optimizer step of ACCUMULATION microbatches, per sharding strategy, with the
    train job's no_sync and without it (Composer's FSDP loop), each on a freshly wrapped tiny U-Net."""
    out: dict[str, Any] = {"microbatches": ACCUMULATION, "fsdp_units": 0}
    for strategy in ("SHARD_GRAD_OP", "FULL_SHARD"):
        accumulating = replace(settings, strategy=strategy, grad_accum=ACCUMULATION)
        torch.manual_seed(0)
        model = tiny_model()
        wrap_like_composer(model, accumulating)
        out["fsdp_units"] = len(FullyShardedDataParallel.fsdp_modules(model.unet))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for no_sync in (True, False):
            count_optimizer_step(model, optimizer, accumulating, no_sync)  # warm-up
            step = count_optimizer_step(model, optimizer, accumulating, no_sync)
            calls: dict[str, int] = {}
            for phase in step.values():
                for name, n in phase["calls"].items():
                    calls[name] = calls.get(name, 0) + n
            key = "no_sync" if no_sync else "sync_every_microbatch"
            out.setdefault(strategy, {})[key] = {
                "all_gathers": sum(n for name, n in calls.items() if "all_gather" in name),
                "reduce_scatters": sum(n for name, n in calls.items() if "reduce_scatter" in name),
                "bytes": sum(phase["bytes"] for phase in step.values()),
            }
        synced, accumulated = (accumulated_grads(model, accumulating, no_sync) for no_sync in (False, True))
        out[strategy]["grad_max_rel_diff"] = max(
            ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
            for a, b in zip(accumulated, synced, strict=True)
        )
    return out


def accumulated_grads(model: DiffusionModel, settings: CommSettings, no_sync: bool) -> list[torch.Tensor]:
    """This rank's gradient shards after `grad_accum` seeded microbatches (then zeroed): the same inputs
    with and without no_sync, so the two differ only by where the sum is taken and in which dtype."""
    torch.manual_seed(1)
    for index in range(settings.grad_accum):
        inputs, target = microbatch_input(MEASURED_MICROBATCH)
        final = not no_sync or index + 1 == settings.grad_accum
        with accumulation_sync(model, final):
            ((model(inputs).float() - target).square().mean() / settings.grad_accum).backward()
    grads = [p.grad.detach().float().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


def _add(total: CollectiveCount, part: CollectiveCount) -> None:
    for name, calls in part.calls.items():
        total.calls[name] = total.calls.get(name, 0) + calls
    total.bytes += part.bytes


def count_ema_update(model: DiffusionModel, smoothing: float) -> dict[str, Any]:
    """Bytes one EMA update moves (0 when sharded) vs gathering the full model once (an unsharded EMA)."""
    ema = build_ema(smoothing, "0ba", "1ba", handoff=False)
    state = SimpleNamespace(model=model)
    ema.apply(Event.INIT, state, logger=None)  # type: ignore[arg-type]
    ema.ema_started = True
    with count_collectives() as update:
        ema.apply(Event.BATCH_END, state, logger=None)  # type: ignore[arg-type]
    with count_collectives() as gather, FullyShardedDataParallel.summon_full_params(model, writeback=False):
        pass
    store = type(ema.ema_model).__name__
    return {"update": _as_json(update), "full_gather": _as_json(gather), "store": store}


def checkpoint_costs(rank: int, work: Path, width: int, depth: int, repeats: int) -> dict[str, Any]:
    """Median seconds per Composer save and bytes each rank wrote, full vs sharded (rank 0's view)."""
    model, optimizer, ema = trained_net(width, depth)
    out: dict[str, Any] = {"params": depth * (width * width + width), "ranks": SCALE_RANKS}
    for fmt in ("full", "sharded"):
        state = composer_state(model, optimizer, fmt, [ema], [])
        seconds, path = [], None
        for attempt in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            path = save_with_composer(state, work / fmt / f"try{attempt}")
            seconds.append(time.perf_counter() - start)  # Composer's save ends in a barrier
        if rank == 0 and path is not None:
            sizes = bytes_written_by_rank(path, SCALE_RANKS)
            out[fmt] = {
                "seconds_per_save": round(statistics.median(seconds), 4),
                "bytes_per_rank": sizes,
                "total_bytes": sum(sizes),
                "max_rank_share": round(max(sizes) / sum(sizes), 3),
            }
    return out


def _rank_main(rank: int, work: str, settings: CommSettings, ckpt: dict[str, int]) -> None:
    init_gloo(rank, SCALE_RANKS, work, tag="-scale")
    torch.manual_seed(0)  # the same initial weights on every rank, as a checkpoint load or broadcast gives
    model = tiny_model()
    params = sum(p.numel() for p in model.parameters())
    wrap_like_composer(model, settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    count_optimizer_step(model, optimizer, settings)  # warm-up: lazy optimizer state, FSDP's first-run setup
    step = count_optimizer_step(model, optimizer, settings)
    ema = count_ema_update(model, smoothing=0.9999)
    accumulation = count_accumulation(settings)
    checkpoint = checkpoint_costs(rank, Path(work), ckpt["width"], ckpt["depth"], ckpt["repeats"])
    if rank == 0:
        result = {"params": params, "settings": asdict(settings), "step": step, "ema": ema}
        result["accumulation"] = accumulation
        (Path(work) / RESULT_NAME).write_text(json.dumps(result | {"checkpoint": checkpoint}))
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives(ckpt_width: int = 256, ckpt_depth: int = 4, ckpt_repeats: int = 3) -> dict[str, Any]:
    """Spawn the 2-rank job; the raw counts (rank 0's) of the EMA update, the optimizer step and the saves."""
    settings = shipped_settings()
    ckpt = {"width": ckpt_width, "depth": ckpt_depth, "repeats": ckpt_repeats}
    with tempfile.TemporaryDirectory(prefix="sd-bench-scale-") as work:
        mp.spawn(_rank_main, args=(work, settings, ckpt), nprocs=SCALE_RANKS, join=True)
        return json.loads((Path(work) / RESULT_NAME).read_text())


def bench_collectives(ckpt_width: int, ckpt_depth: int, ckpt_repeats: int) -> dict[str, Any]:
    """The summarized counters, and the job's wall time (mostly 2 processes importing Composer)."""
    start = time.perf_counter()
    summary = summarize_collectives(measure_collectives(ckpt_width, ckpt_depth, ckpt_repeats))
    return summary | {"seconds": round(time.perf_counter() - start, 1)}


# ------------------------------------------------------------------------------------------- summaries
def dtype_bytes(precision_name: str) -> int:
    """Bytes per element of a Composer precision name (amp_bf16 -> bf16 -> 2)."""
    return DTYPE_BYTES[precision_name.removeprefix("amp_")]


def step_bytes_per_param(raw: dict[str, Any]) -> dict[str, float]:
    """Measured bytes of the full tensor per parameter per step: the forward's all-gathers and the
    backward's reduce-scatters (under SHARD_GRAD_OP they are the only collectives of those phases; each
    passes the full tensor plus its 1/W shard through the call)."""
    through_call = (1 + 1 / SCALE_RANKS) * raw["params"]
    return {
        "all_gather": raw["step"]["forward"]["bytes"] / through_call,
        "reduce_scatter": raw["step"]["backward"]["bytes"] / through_call,
    }


def planner_bytes_per_param(settings: dict[str, Any], params: int) -> dict[str, float]:
    """shared/estimate/cluster.py's `step_comm` for the same settings, in the same unit (its ring bytes
    divided by the ring factor (W-1)/W and by the parameter count)."""
    mixed = settings["mixed_precision"]
    comm = step_comm(
        params, SCALE_RANKS, settings["grad_accum"], settings["strategy"],
        dtype_bytes(mixed["param_dtype"]), dtype_bytes(mixed["reduce_dtype"]),
    )  # fmt: skip
    ring = (SCALE_RANKS - 1) / SCALE_RANKS * params
    return {"all_gather": comm.all_gather_bytes / ring, "reduce_scatter": comm.reduce_scatter_bytes / ring}


def summarize_collectives(raw: dict[str, Any]) -> dict[str, Any]:
    """The scale section's collective counters: EMA update bytes, the step's calls and bytes per parameter
    beside the planner's formula, their extrapolation to SD2-base on the recipe's cluster, checkpoints."""
    settings, step = raw["settings"], raw["step"]
    measured = step_bytes_per_param(raw)
    planned = planner_bytes_per_param(settings, raw["params"])
    world = settings["world_size"]
    sd2_ring = (world - 1) / world * PRESET_PARAMS["sd2-base"]
    calls: dict[str, int] = {}
    for phase in step.values():
        for name, n in phase["calls"].items():
            calls[name] = calls.get(name, 0) + n
    return {
        "ema_update_bytes": raw["ema"]["update"]["bytes"],
        "ema_update_calls": sum(raw["ema"]["update"]["calls"].values()),
        "ema_store": raw["ema"]["store"],
        "full_model_gather_bytes": raw["ema"]["full_gather"][
            "bytes"
        ],  # what an unsharded EMA moved per update
        "step_settings": settings,
        "step_model_params": raw["params"],
        "step_calls": dict(sorted(calls.items())),
        "step_bytes": sum(phase["bytes"] for phase in step.values()),
        "step_by_phase": step,
        "step_bytes_per_param": {k: round(v, 4) for k, v in measured.items()},
        "planner_bytes_per_param": planned,
        "planner_agrees": all(
            abs(measured[k] - planned[k]) <= PLANNER_TOLERANCE * planned[k] for k in planned
        ),
        "sd2_gb_per_rank_per_step": {k: round(v * sd2_ring / GB, 3) for k, v in measured.items()},
        "checkpoint": raw["checkpoint"],
        "accumulation": raw.get("accumulation", {}),
    }
