"""The train job's config: one nested dataclass, loaded from `jobs/train/<name>.yaml` + `key=value` overrides.

Batch sizes are given as `global_batch_size` and `device_microbatch_size`; the per-rank batch and gradient
accumulation are derived at launch (`shared.batching.derive_batching`), never written into configs.
Composer time strings (`20ba`, `1ep`, `10000sp`, `0.5dur`) are used for every duration and interval.

The package: checks.py (time strings, literals), data.py (`data`: one dataset or a mix), sections.py (model,
optimizer, EMA, samples, eval, log, resilience), job.py (`TrainConfig`), memory.py (the microbatch
against a GPU's memory, the line the dry-run plan and a run's start share). Import from `train.config`.
"""

from train.config.checks import (
    SD2_PROMPTS,
    Device,
    Precision,
    PredictionType,
    SamplerKind,
    check_time_string,
    time_count,
)
from train.config.data import DataConfig, StreamConfig
from train.config.job import TrainConfig
from train.config.sections import (
    EMAConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    OptimizerConfig,
    ResilienceConfig,
    SamplesConfig,
    check_eval,
)

__all__ = [
    "SD2_PROMPTS",
    "DataConfig",
    "Device",
    "EMAConfig",
    "EvalConfig",
    "LogConfig",
    "ModelConfig",
    "OptimizerConfig",
    "Precision",
    "PredictionType",
    "ResilienceConfig",
    "SamplerKind",
    "SamplesConfig",
    "StreamConfig",
    "TrainConfig",
    "check_eval",
    "check_time_string",
    "time_count",
]
