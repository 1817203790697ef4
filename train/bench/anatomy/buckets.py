"""The step at each aspect-ratio bucket's shape (issue 32): images/s per bucket against the square, the graphs
and recompiles a compiled U-Net makes over the buckets (bounded: one static graph set per bucket, as the
train job sets dynamo up with `train.data.buckets.compile_per_bucket`), and train's loader over a bucketed
dataset (one Streaming stream per bucket, per_stream batches: `train.data.buckets.run_streams`).

Buckets hold about resolution^2 pixels, so a bucket's step should cost about a square's; a bucket far off
(a shape cuDNN or inductor handles badly) shows as a lower images/s than its pixels explain.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from shared.buckets import parse_bucket
from shared.presets import get_preset
from shared.runtime.device import DeviceSetup
from train.bench.anatomy.compiled import _dynamo_counts
from train.bench.config import BenchConfig
from train.bench.data import bench_loader, write_synthetic_dataset
from train.bench.step import StepBench, synthetic_latent_batch, time_calls, train_step
from train.config import TrainConfig
from train.data.buckets import compile_per_bucket
from train.model.assemble import forget_compiled_code
from train.model.kernels import is_compiled

_DYNAMO_SETTINGS = ("automatic_dynamic_shapes", "recompile_limit", "accumulated_recompile_limit")


def bench_buckets(cfg: BenchConfig, recipe: TrainConfig, setup: DeviceSetup, work: Path) -> dict[str, Any]:
    """The bucket section: per bucket the step's images/s; compile counts and the loader when configured."""
    res, batch_size, names = cfg.bucket_resolution(), cfg.bucket_batch(), cfg.bucket_names()
    torch.manual_seed(cfg.seed)
    bench = StepBench(recipe, setup, online=False)
    preset = get_preset(cfg.preset)
    batches = {
        name: synthetic_latent_batch(preset, res, batch_size, setup, cfg.seed, parse_bucket(name))
        for name in names
    }
    out: dict[str, Any] = {"resolution": res, "batch_size": batch_size}
    unet, backend = bench.model.unet, cfg.buckets.compile_backend
    # Timed as the `train` section times its square step: compiled where the recipe compiles (a GPU recipe
    # with compile on; each bucket's warm-up pays its compile), eager otherwise; a compile of the bench's own
    # (`buckets.compile_backend`) then only counts graphs, so its dynamo overhead is not in the images/s.
    if is_compiled(unet):
        with per_bucket_dynamo(unet, len(names), ""):
            out["steps"], graphs = time_buckets(bench, batches, cfg, res)
            out["compile"] = second_round(bench, batches, "recipe", graphs)
    else:
        out["steps"], _ = time_buckets(bench, batches, cfg, res)
        if backend:
            with per_bucket_dynamo(unet, len(names), backend):
                graphs = {name: graphs_added(bench, batch) for name, batch in batches.items()}
                out["compile"] = second_round(bench, batches, backend, graphs)
    if cfg.buckets.loader_rows:
        root = work / "dataset-buckets"
        write_synthetic_dataset(root, preset, res, cfg.buckets.loader_rows, cfg.seed, names)
        out["loader"] = bench_loader(
            root, res, batch_size, cfg.loader.num_workers, cfg.loader.passes, work / "buckets-cache", cfg.seed
        )
        out["loader"]["rows_per_bucket"] = cfg.buckets.loader_rows
    return out


def time_buckets(
    bench: StepBench, batches: dict[str, Any], cfg: BenchConfig, res: int
) -> tuple[dict[str, Any], dict[str, int]]:
    """Per bucket: the step's images/s, times and pixels against the square; and the graphs it added."""
    steps, graphs = {}, {}
    for name, batch in batches.items():
        before = _dynamo_counts()["graphs"]
        step = lambda b=batch: train_step(bench.model, bench.optimizer, b, bench.setup)  # noqa: E731
        timing = time_calls(step, cfg.buckets.warmup, cfg.buckets.repeats, bench.setup)
        graphs[name] = _dynamo_counts()["graphs"] - before
        height, width = parse_bucket(name)
        steps[name] = {
            "images_per_s_per_device": cfg.bucket_batch() / timing.median,
            "step": timing.to_json(),
            "pixels_vs_square": height * width / (res * res),
        }
    return steps, graphs


def graphs_added(bench: StepBench, batch: Any) -> int:
    """Graphs dynamo makes for one train step on `batch`."""
    before = _dynamo_counts()["graphs"]
    train_step(bench.model, bench.optimizer, batch, bench.setup)
    return _dynamo_counts()["graphs"] - before


@contextmanager
def per_bucket_dynamo(unet: torch.nn.Module, buckets: int, backend: str) -> Iterator[str]:
    """Dynamo set up as the train job sets it up on bucketed data (`compile_per_bucket`) for the recipe's own
    compile, or for `backend` on an eager U-Net, compiled here. Yields the backend in use ("recipe", the
    backend, or "": eager); dynamo's settings and, where the compile was the bench's, the eager U-Net are
    restored afterwards."""
    config = torch._dynamo.config
    saved = {name: getattr(config, name) for name in _DYNAMO_SETTINGS}
    own = backend and not is_compiled(unet)
    in_use = "recipe" if is_compiled(unet) else backend
    forget_compiled_code()
    torch._dynamo.utils.counters.clear()
    try:
        compile_per_bucket(buckets, compile=bool(in_use))
        if own:
            unet.compile(backend=backend, dynamic=False)  # as train/model/assemble.py compiles it
        yield in_use
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
        if own:
            unet._compiled_call_impl = None  # eager again for whatever the bench runs next
        forget_compiled_code()


def second_round(
    bench: StepBench, batches: dict[str, Any], backend: str, graphs_by_bucket: dict[str, int]
) -> dict[str, Any]:
    """Compile counts over the buckets: the graphs each bucket added at its first steps, and one more step
    at every bucket (graphs added then: 0 when every shape kept its graphs)."""
    first = _dynamo_counts()
    for batch in batches.values():
        train_step(bench.model, bench.optimizer, batch, bench.setup)
    added = _dynamo_counts()["graphs"] - first["graphs"]
    return {
        "backend": backend,
        "buckets": len(batches),
        "graphs": first["graphs"],
        "graphs_by_bucket": graphs_by_bucket,
        # the bound: no bucket makes more graphs than the first shape did (one static graph set per bucket)
        "graph_bound": len(batches) * next(iter(graphs_by_bucket.values()), 0),
        # each graph a later bucket adds recompiles a code object compiled at the first bucket's shape
        # (dynamo's own `recompiles` counter stayed 0 here on torch 2.7 with static shapes)
        "recompiles": sum(list(graphs_by_bucket.values())[1:]),
        "graphs_second_round": added,
        "graph_breaks": first["graph_breaks"],
    }


# ---------------------------------------------------------------------------------------------- report
def bucket_rows(buckets: dict[str, Any], square_rate: float | None) -> list[list[str]]:
    """Table rows: the step per bucket (against the square step of the train table), compile, loader."""
    res = buckets["resolution"]
    rows = []
    for name, step in buckets["steps"].items():
        rate = step["images_per_s_per_device"]
        vs = f"; {rate / square_rate:.2f}x the square step" if square_rate else ""
        rows.append(
            [
                f"step at bucket {name} ({res} px, batch {buckets['batch_size']})",
                f"{rate:,.2f} img/s",
                f"{step['pixels_vs_square']:.3f} of the square's pixels{vs}",
            ]
        )
    if c := buckets.get("compile"):
        by_bucket = ", ".join(f"{name} {n}" for name, n in c["graphs_by_bucket"].items())
        rows.append(
            [
                f"compiled U-Net over {c['buckets']} buckets ({c['backend']})",
                f"{c['graphs']} graphs, {c['recompiles']} recompiles",
                f"bound {c['graph_bound']}; by bucket {by_bucket}; 2nd round adds {c['graphs_second_round']}",
            ]
        )
    if loader := buckets.get("loader"):
        rows.append(
            [
                f"loader over {len(buckets['steps'])} buckets (per_stream)",
                f"{loader['images_per_s']:,.1f} img/s",
                f"{loader['rows_per_bucket']} rows per bucket, batch {loader['batch_size']}",
            ]
        )
    return rows


def bucket_findings(buckets: dict[str, Any]) -> list[str]:
    steps = buckets["steps"]
    rates = ", ".join(f"{name} {s['images_per_s_per_device']:,.2f}" for name, s in steps.items())
    notes = [f"{buckets['resolution']} px buckets, img/s per device: {rates}"]
    if c := buckets.get("compile"):
        over = c["graphs"] > c["graph_bound"] or c["graphs_second_round"]
        verdict = " - over the bound: a bucket recompiled" if over else " (within one graph set per bucket)"
        notes.append(
            f"compiled U-Net over {c['buckets']} buckets: {c['graphs']} graphs, {c['recompiles']} recompiles"
            + verdict
        )
    return notes
