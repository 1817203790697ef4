"""Human-readable summaries of an encode run (machine-readable ones are metrics.json and the markers)."""

from __future__ import annotations

import typer

from encode.config import EncodeConfig
from encode.pipeline import RankSummary
from encode.publish.finalize import PublishResult


def print_rank(summary: RankSummary) -> None:
    who = f"rank {summary.rank}/{summary.world_size}"
    if summary.partitions_mine == summary.partitions_done_before:
        typer.echo(
            f"{who}: up to date ({summary.partitions_mine} partitions already encoded for this config)"
        )
        return
    done = len(summary.markers)
    rate = summary.images_encoded / summary.seconds if summary.seconds else 0.0
    typer.echo(
        f"{who}: encoded {done} partitions ({summary.partitions_done_before} already done), "
        f"{summary.samples_read} samples read, {summary.samples_written} rows written, "
        f"{summary.images_encoded} images through the VAE ({rate:.1f} img/s), {summary.seconds:.1f} s"
    )
    if summary.main_thread and summary.seconds:
        # Which stage bounds this rank: mostly waiting for the device or for the workers is the bound
        # (a faster model or more `workers`); launch / writing / publishing is host work.
        spent = ", ".join(
            f"{name.replace('_', ' ')} {100 * seconds / summary.seconds:.0f}%"
            for name, seconds in summary.main_thread.items()
        )
        if summary.main_thread_launch:
            parts = ", ".join(
                f"{name.replace('_', ' ')} {100 * seconds / summary.seconds:.0f}%"
                for name, seconds in summary.main_thread_launch.items()
            )
            spent += f" (launch: {parts})"
        typer.echo(f"{who}: main thread: {spent}")
    busy, idle = summary.device.get("busy", 0.0), summary.device.get("idle", 0.0)
    if busy + idle:
        # Idle here is the device with nothing queued between two model calls: the host was the bound.
        typer.echo(
            f"{who}: device: busy {busy:.1f} s ({summary.images_encoded / busy if busy else 0:.1f} img/s), "
            f"idle {100 * idle / (busy + idle):.0f}% of the time between its first model call and its last"
        )
    reused_text = sum(m.reused["text"] for m in summary.markers)
    reused_latents = sum(sum(m.reused["latents"].values()) for m in summary.markers)
    if reused_text or reused_latents:
        typer.echo(
            f"{who}: reused {reused_text} text embeddings and {reused_latents} latents from earlier outputs"
        )
    for pid, err in sorted(summary.failed.items()):
        typer.echo(f"{who}: partition {pid} FAILED (rerun to retry): {err.splitlines()[0]}", err=True)


def print_publish(result: PublishResult, cfg: EncodeConfig, seconds: float) -> None:
    m = result.manifest
    state = "published new version" if result.new_version else "dataset up to date, version"
    typer.echo(f"{state} {m.version} at {cfg.output.uri} ({seconds:.1f} s)")
    for res, info in sorted(m.resolutions.items()):
        per = info.bytes / info.num_samples if info.num_samples else 0
        typer.echo(
            f"  {res:>5} px: {info.num_samples} samples, {per / 1024:.1f} KiB/sample, "
            f"{info.smaller_than_resolution} too small for this resolution"
        )
        for name, bucket in (info.buckets or {}).items():
            share = 100 * bucket["num_samples"] / info.num_samples if info.num_samples else 0.0
            typer.echo(f"        bucket {name:>9}: {bucket['num_samples']} samples ({share:.1f}%)")
    rejected = sum(m.rejected.values())
    typer.echo(f"  read {m.samples_read} samples, rejected {rejected}:")
    for reason, count in sorted(m.rejected.items(), key=lambda kv: -kv[1]):
        typer.echo(f"    {reason:<24} {count}")
