"""`python -m train eval`: the held-out loss of one checkpoint, with the numbers training logged.

The eval settings come from the checkpoint's RunRecord (the run's `eval` section), then `key=value`
overrides (`uri=...`, `num_samples=...`; an `eval.` prefix is accepted). The U-Net is rebuilt from the
record with the EMA or the training weights (train/ema/algorithm.py `select_unet_weights`), the objective
from the record's model settings and scale factor, and evaluated by train/eval/heldout.py on one process:
the pairs and their noise do not depend on the rank count, so this equals what training logged at that step.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared import storage
from shared.config import ConfigError, build_dataclass, load_config
from shared.encoders import EncoderIdentity
from shared.presets import get_preset
from shared.runtime.device import resolve_device_kind, resolve_precision
from train.checkpoints.files import fetched_checkpoint, resolve_checkpoint
from train.checkpoints.sharded import read_full_checkpoint
from train.config import EvalConfig, ModelConfig, check_eval
from train.data.mix import encoder_facts
from train.ema.algorithm import select_unet_weights
from train.eval.cost import num_batches
from train.eval.data import pin_eval_data, rows_for_rank
from train.eval.heldout import heldout_sums, loss_metrics, rank_pairs
from train.export.pipeline import ExportError, run_record_of
from train.model.diffusion import Objective
from train.model.online_text import online_text_for

log = logging.getLogger(__name__)

DEFAULT_BATCH = 8  # (sample, timestep) pairs per forward when the run's eval.batch_size was 0


@dataclass
class CheckpointEval:
    checkpoint: str
    weights: str  # what select_unet_weights found: "ema", "training", "training (no EMA in checkpoint)"
    step: int
    metrics: dict[str, float]


def eval_config(record: dict[str, Any], overrides: list[str]) -> EvalConfig:
    """The run's eval section with `key=value` overrides applied, checked like a train config's."""
    relative = [item.strip().removeprefix("eval.") for item in overrides]
    cfg = load_config(EvalConfig, dict(record.get("eval") or {}), relative)
    check_eval(cfg, int(record["model"].get("num_train_timesteps", 1000)))
    if not cfg.uri:
        raise ConfigError(
            "this run had no eval section: pass uri=<an encoded held-out dataset> (and e.g. num_samples=2048)"
        )
    return cfg


def build_unet(state: dict[str, Any], record: dict[str, Any], weights: str, device: str) -> tuple[Any, str]:
    from diffusers import UNet2DConditionModel

    unet_weights, what = select_unet_weights(state, weights)
    unet = UNet2DConditionModel.from_config(record["unet_config"])
    unet.load_state_dict(unet_weights, strict=True)
    return unet.to(device).eval(), what


def checkpoint_step(state: dict[str, Any]) -> int:
    """The batch count a Composer checkpoint was written at (-1 when it has no timestamp)."""
    stamp = state.get("timestamp", {})
    return int(stamp.get("Timestamp", stamp).get("batch", -1))


def evaluate_checkpoint(
    checkpoint: str,
    weights: str = "ema",
    overrides: list[str] | None = None,
    cache_dir: str = "",
    size: str = "",
) -> CheckpointEval:
    """The held-out loss of a checkpoint (file, sharded folder or save folder -> its latest); `size`: the
    bucket ("HxW" px) of a bucketed eval dataset (default its square)."""
    if weights not in ("ema", "training"):
        raise ExportError(f"--weights must be ema or training, got {weights!r}")
    source = resolve_checkpoint(checkpoint)
    with fetched_checkpoint(source) as local:
        state = read_full_checkpoint(local)["state"]
    record = run_record_of(state)
    cfg = eval_config(record, overrides or [])
    device = "cuda" if resolve_device_kind("auto") == "gpu" else "cpu"
    unet, what = build_unet(state, record, weights, device)
    step = checkpoint_step(state)
    del state
    model_cfg = build_dataclass(ModelConfig, record["model"])
    trained_with = encoder_facts(EncoderIdentity.from_record(record), float(record["scale_factor"]))
    pinned = pin_eval_data(
        cfg, record["preset"], record["dataset"]["resolution"], cache_dir, trained_with, size
    )
    empty = torch.zeros(get_preset(record["preset"]).text_shape())  # never used: eval drops no caption
    online = online_text_for(pinned.manifest, model_cfg.text_encoder)
    objective = Objective(model_cfg, float(record["scale_factor"]), empty, online)
    rows = rows_for_rank(pinned, cfg.num_samples, 0, 1)
    batch = cfg.batch_size or DEFAULT_BATCH
    batches = rank_pairs(rows, cfg.timesteps, batch, num_batches(cfg, 1, batch))
    precision = resolve_precision("auto", "gpu" if device == "cuda" else "cpu")

    def denoise(x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", torch.bfloat16, enabled=precision == "amp_bf16"):
            return unet(x, t, encoder_hidden_states=text).sample

    sums = heldout_sums(denoise, objective, rows, cfg, batches, torch.device(device))
    label = "ema" if what == "ema" else "training"
    return CheckpointEval(source, what, step, loss_metrics(sums, cfg.timesteps, label))


def write_metrics(result: CheckpointEval, out: str) -> None:
    """Flat JSON with metrics.jsonl's keys (local path or s3://)."""
    text = json.dumps(result.metrics, indent=1, sort_keys=True) + "\n"
    if not storage.is_s3(out):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    storage.write_bytes(out, text.encode())
