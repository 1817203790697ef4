"""The FSDP settings the trainer hands Composer: the gradient reduce dtype comes from the config."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from composer.distributed.mosaic_parallelism import get_mixed_precision

from shared.config import ConfigError, load_config
from train.config import TrainConfig
from train.loop.trainer import parallelism_config


def _ctx(cfg: TrainConfig) -> Any:
    """The parts of a RunContext parallelism_config reads (one rank: full checkpoints)."""
    return SimpleNamespace(cfg=cfg, precision="amp_bf16", batching=SimpleNamespace(world_size=1))


@pytest.mark.parametrize(("reduce", "expected"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_fsdp_reduce_dtype_reaches_composers_mixed_precision(reduce: str, expected: torch.dtype) -> None:
    cfg = load_config(TrainConfig, "sd2-base-256", [f"fsdp_reduce_dtype={reduce}"], kind="train").for_world(2)
    fsdp = parallelism_config(_ctx(cfg))["fsdp"]  # type: ignore[index]
    assert fsdp["sharding_strategy"] == "SHARD_GRAD_OP"
    # Composer's own interpretation of the setting, as its FSDP wrapper calls it
    mp, param_dtype, reduce_dtype, buffer_dtype = get_mixed_precision("amp_bf16", fsdp["mixed_precision"])
    assert (param_dtype, reduce_dtype, buffer_dtype) == (torch.bfloat16, expected, torch.bfloat16)
    assert mp.reduce_dtype == expected


def test_default_matches_composers_default_mixed_precision() -> None:
    cfg = load_config(TrainConfig, "sd2-base-512", kind="train").for_world(2)
    fsdp = parallelism_config(_ctx(cfg))["fsdp"]  # type: ignore[index]
    ours = get_mixed_precision("amp_bf16", fsdp["mixed_precision"])[1:]
    assert ours == get_mixed_precision("amp_bf16", "DEFAULT")[1:]


def test_unknown_reduce_dtype_is_refused() -> None:
    with pytest.raises(ConfigError, match="fsdp_reduce_dtype"):
        load_config(TrainConfig, "sd2-base-256", ["fsdp_reduce_dtype=fp8"], kind="train")
