"""text.store in `make bench`: the train step on stored embeddings vs on token ids with the text tower in it.

Both steps run the train job's own model (train/model/assemble.py) and optimizer on one device; the tokens
step's Objective holds the frozen tower exactly as a text.store=tokens run does (train/model/online_text.py),
so the measured difference is the tower's forward under no_grad plus the fp16 rounding. The two are timed
alternately (`time_interleaved`), and the ratio is the median of per-pair ratios, next to the FLOP-ideal ratio
(U-Net train step + text tower) / U-Net train step. `make estimate ARGS='throughput_from=...'` reads
`text_store.<res>.ratio` to price the tower's extra GPU-hours.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from shared.contract import TEXT_EMBEDDING, TEXT_TOKENS
from shared.models import build_text_encoder
from shared.presets import get_preset, random_init
from shared.runtime.device import DeviceSetup
from train.bench.config import StepBenchConfig
from train.bench.step import FlopCounts, StepBench, synthetic_latent_batch, time_interleaved, train_step
from train.config import TrainConfig
from train.model.assemble import forget_compiled_code
from train.model.online_text import OnlineText


def tokens_batch(
    embedded: dict[str, torch.Tensor], vocab: int, length: int, seed: int
) -> dict[str, torch.Tensor]:
    """The same batch as a text.store=tokens loader delivers it: uint16 token ids instead of embeddings."""
    gen = torch.Generator().manual_seed(seed)
    batch = {k: v for k, v in embedded.items() if k != TEXT_EMBEDDING}
    device = embedded[TEXT_EMBEDDING].device
    ids = torch.randint(0, vocab, (embedded[TEXT_EMBEDDING].shape[0], length), generator=gen)
    batch[TEXT_TOKENS] = ids.to(torch.uint16).to(device)
    return batch


def online_text(train_cfg: TrainConfig, setup: DeviceSetup) -> OnlineText:
    """The preset's text tower (random weights: shapes decide speed) as a tokens run holds it."""
    preset = random_init(get_preset(train_cfg.model.preset))
    encoder = build_text_encoder(preset, "transformers").to(setup.device)
    empty = encoder.tokenize([""])[0]
    return OnlineText(encoder, empty)


def measure_text_store(
    bench: StepBench, resolution: int, plan: StepBenchConfig, flops: FlopCounts, seed: int
) -> dict[str, Any]:
    forget_compiled_code()  # each resolution is its own train run (train/model/assemble.py)
    setup, model, optimizer = bench.setup, bench.model, bench.optimizer
    batch_size = plan.batch_for(resolution)
    stored = synthetic_latent_batch(bench.preset, resolution, batch_size, setup, seed)
    tokens = tokens_batch(stored, int(bench.preset.text["vocab_size"]), bench.preset.text_length, seed)
    calls: dict[str, Callable[[], Any]] = {
        "embeddings": lambda: train_step(model, optimizer, stored, setup),
        "tokens": lambda: train_step(model, optimizer, tokens, setup),
    }
    timings = time_interleaved(calls, plan.warmup, plan.repeats, setup)
    pairs = zip(timings["tokens"].seconds, timings["embeddings"].seconds, strict=True)
    return {
        "batch_size": batch_size,
        "embeddings_step": timings["embeddings"].to_json(),
        "tokens_step": timings["tokens"].to_json(),
        # Median of per-repeat ratios: each pair ran back to back, under the same machine load.
        "ratio": statistics.median(t / e for t, e in pairs),
        "flop_ideal_ratio": (flops.unet_train_step + flops.text_tower) / flops.unet_train_step,
        "text_tower_gflop": flops.text_tower / 1e9,
        "unet_train_step_gflop": flops.unet_train_step / 1e9,
    }


def bench_text_store(
    train_cfg: TrainConfig, setup: DeviceSetup, plan: StepBenchConfig, flops: dict[int, FlopCounts], seed: int
) -> dict[str, dict[str, Any]]:
    """Per resolution (string keys): stored-embeddings vs tokens step time, their ratio and the FLOP-ideal."""
    torch.manual_seed(seed)
    bench = StepBench(train_cfg, setup, online=False)
    bench.model.objective.online_text = online_text(train_cfg, setup)
    return {str(res): measure_text_store(bench, res, plan, flops[res], seed) for res in plan.text_store_at()}
