"""Streaming's own StreamingDataset, for tests that read shards as any Streaming user would."""

from __future__ import annotations

from typing import Any

from train.data.streaming_host import streaming_prefix_lock


def plain_streaming_dataset(**kwargs: Any) -> Any:
    """`StreamingDataset(**kwargs)`, built the way train builds its own (train/data/streaming_host.py
    `streaming_prefix_lock`): its prefix scan holds no descriptor, and its shared memory goes with it. Built
    bare, Streaming keeps every segment it scanned past and its own open until the process exits: late in
    a suite worker each such test held ~100 more descriptors."""
    from streaming import StreamingDataset

    with streaming_prefix_lock() as created:
        return created(StreamingDataset(**kwargs))
