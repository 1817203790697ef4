"""The time-and-cost planner (`make estimate`): measured throughput -> days, GPU-hours and dollars.

Pure Python + matplotlib (imported only to draw the plot): no torch, no Composer, so it answers instantly.

Model, per schedule phase (one resolution, a number of training samples):

    efficiency(N) = 1                                         for N <= reference_gpus
                  = efficiency ** log2(N / reference_gpus)    scaling.model = log2 (kept per doubling)
                  = efficiency                                scaling.model = constant
    cluster images/s = images/s/GPU (measured on reference_gpus) * N * efficiency(N)
    wall hours       = samples / cluster images/s / 3600 / goodput
    GPU-hours        = wall hours * N;   dollars = GPU-hours * $/GPU-hour (pricing.mode)

plus the one-time encode (samples / (images/s/GPU * 3600) GPU-hours on the encoder GPUs) and storage of the
encoded shards (bytes/sample * samples kept, per resolution, * $/GiB-month * months).

`throughput_from=<bench.json>` reads the `make bench` result instead of `throughput.per_gpu`:

    {
      "device": "NVIDIA A100-SXM4-40GB",   # torch.cuda.get_device_name(); mapped to a GPU_TABLE type
      "num_devices": 8,                    # optional: GPUs the numbers were measured on; replaces
                                           #   scaling.reference_gpus when above it (below it, scaling
                                           #   up to reference_gpus is taken as linear, with a note)
      "train": {                           # per resolution (px, as a string key)
        "256": {"images_per_s_per_device": 185.0},
        "512": {"images_per_s_per_device": 42.0}
      },
      "encode": {"images_per_s_per_device": 60.0}   # optional: source images encoded per s per GPU, all
                                                    #   resolutions of a sample included; or per resolution
                                                    #   {"256": {...}, "512": {...}} (times add up)
    }

`storage.manifest=<encode output root or manifest.json>` reads bytes per sample from a real encode:
`resolutions.<res>.bytes / num_samples.<res>` (see shared/manifest.py `DatasetManifest.to_json`), and the
share of read samples each resolution kept (`num_samples.<res> / samples_read`, images smaller than a
resolution are never upscaled) to size the full dataset from `encode.samples`.

The published runs this reproduces, with their inputs, are tabulated in tests/shared/test_estimate.py.

Modules: gpus (GPU table, constants), config (typed config), inputs (bench JSON, manifest sizes), model
(the estimate), report (table, markdown, plot, JSON), cli (the typer command).
"""

from __future__ import annotations

from shared.estimate.cli import estimate_command
from shared.estimate.config import EstimateConfig, load_estimate_config
from shared.estimate.gpus import DEFAULT_SWEEP, GPU_TABLE, EstimateError, GpuSpec, gpu_type_for_device
from shared.estimate.inputs import read_bench, read_manifest_sizes
from shared.estimate.model import Estimate, estimate, estimate_for_plan, sweep_gpu_counts
from shared.estimate.report import render_markdown, render_table, write_outputs

__all__ = [
    "DEFAULT_SWEEP",
    "GPU_TABLE",
    "Estimate",
    "EstimateConfig",
    "EstimateError",
    "GpuSpec",
    "estimate",
    "estimate_command",
    "estimate_for_plan",
    "gpu_type_for_device",
    "load_estimate_config",
    "read_bench",
    "read_manifest_sizes",
    "render_markdown",
    "render_table",
    "sweep_gpu_counts",
    "write_outputs",
]
