"""Per-sample and per-row-group byte budgets, and the stored-caption cap (issue 14.8).

Budgets are set small through SourceConfig so nothing here allocates hundreds of MB; one test measures
with tracemalloc that skipped members are never read into memory.
"""

from __future__ import annotations

import io
import tarfile
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from encode.config import EncodeConfig, OutputConfig, SourceConfig
from encode.process.prepare import _Selected, select_sample
from encode.sample_data import encode_image
from encode.sources import (
    RawSample,
    count_by_reason,
    list_partitions,
    read_parquet,
    read_partition,
    read_webdataset,
)

EXTRA_MEMBER_BYTES = 8 << 20  # 4 unused members of 8 MiB under one key: 32 MiB if they were kept
EXTRA_MEMBERS = 4
# Reading the tar may hold a member-sized buffer or two, never the 32 MiB of unused members.
MAX_TRACED_PEAK = 2 << 20


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def small_jpeg() -> bytes:
    from PIL import Image

    return encode_image(Image.new("RGB", (8, 8), (200, 10, 10)), "JPEG")


def test_unused_members_are_never_read(tmp_path: Path) -> None:
    image = small_jpeg()
    extras = [(f"a.extra{i}.bin", bytes(EXTRA_MEMBER_BYTES)) for i in range(EXTRA_MEMBERS)]
    write_tar(tmp_path / "x.tar", [("a.jpg", image), ("a.txt", b"a caption"), *extras])
    tracemalloc.start()
    try:
        items = list(read_webdataset(str(tmp_path / "x.tar"), SourceConfig()))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count_by_reason(items) == {"good": 1}
    assert items[0].image == image  # type: ignore[union-attr]
    assert peak < MAX_TRACED_PEAK, f"reading held {peak / 2**20:.1f} MiB"


def test_a_sample_over_its_byte_budget_is_skipped_and_counted(tmp_path: Path) -> None:
    image = small_jpeg()
    members = [
        ("a.jpg", image),
        ("a.txt", b"x" * 700),  # image + caption over the budget together, each alone within
        ("b.jpg", image),
        ("b.txt", b"fits"),
        ("c.jpg", b"y" * 2000),  # one file alone over the budget
        ("c.txt", b"fits"),
    ]
    write_tar(tmp_path / "x.tar", members)
    cfg = SourceConfig(max_sample_bytes=len(image) + 600)
    items = list(read_webdataset(str(tmp_path / "x.tar"), cfg))
    assert count_by_reason(items) == {"good": 1, "sample_too_large": 1, "file_too_large": 1}
    assert [i.key for i in items if isinstance(i, RawSample)] == ["b"]


def test_parquet_row_group_over_budget_is_skipped_from_metadata(tmp_path: Path) -> None:
    image = small_jpeg()
    path = tmp_path / "p.parquet"
    small = {"jpg": [image] * 3, "caption": ["a", "b", "c"], "key": ["0", "1", "2"]}
    # ~3 MB of one repeated byte: compresses to a few KB on disk, but the metadata says how big it is.
    big = {"jpg": [image, image], "caption": ["z" * (3 << 20), "y"], "key": ["3", "4"]}
    with pq.ParquetWriter(path, pa.table(small).schema) as writer:
        writer.write_table(pa.table(small))
        writer.write_table(pa.table(big))
    assert path.stat().st_size < 200_000
    cfg = SourceConfig(uri=str(path), max_row_group_bytes=1 << 20)
    items = list(read_parquet(str(path), cfg))
    assert count_by_reason(items) == {"good": 3, "row_group_too_large": 2}
    cfg = SourceConfig(uri=str(path), max_sample_bytes=1 << 20)  # read, but the big row is over budget
    assert count_by_reason(list(read_parquet(str(path), cfg))) == {"good": 4, "sample_too_large": 1}


def test_folder_sample_over_budget_is_skipped_from_the_listing(tmp_path: Path) -> None:
    image = small_jpeg()
    (tmp_path / "a.jpg").write_bytes(image)
    (tmp_path / "a.txt").write_text("c" * 5000)
    (tmp_path / "b.jpg").write_bytes(image)
    (tmp_path / "b.txt").write_text("fits")
    cfg = SourceConfig(uri=str(tmp_path), max_sample_bytes=len(image) + 1000, folder_partitions=1)
    (part,) = list_partitions(cfg)
    assert count_by_reason(list(read_partition(part, cfg))) == {"good": 1, "sample_too_large": 1}


def test_stored_captions_are_cut_to_max_caption_chars() -> None:
    cfg = EncodeConfig(source=SourceConfig(uri="unused"), output=OutputConfig(uri="unused"))
    from PIL import Image

    image = encode_image(Image.new("RGB", (300, 300), (200, 10, 10)), "JPEG")
    caption = "a red square " * 800_000  # ~10 MB
    chosen = select_sample(RawSample("k", image, caption, {"punsafe": 0, "pwatermark": 0}), cfg)
    assert isinstance(chosen, _Selected)
    assert chosen.caption == caption[: cfg.source.max_caption_chars]
    assert len(chosen.text_input) <= cfg.caption.max_chars


def test_folder_links_leaving_the_source_are_refused(tmp_path: Path) -> None:
    """Issue 14.5: `cat.txt` symlinked to a credentials file became the stored caption."""
    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key = hunter2")
    src = tmp_path / "src"
    src.mkdir()
    image = small_jpeg()
    (src / "cat.jpg").write_bytes(image)
    (src / "cat.txt").symlink_to(secret)
    (src / "dog.jpg").symlink_to(tmp_path / "outside.jpg")
    (tmp_path / "outside.jpg").write_bytes(image)
    (src / "owl.jpg").write_bytes(image)
    (src / "owl.txt").write_text("an owl")
    (src / "owl-alias.jpg").symlink_to(src / "owl.jpg")  # a link that stays inside: fine
    (src / "owl-alias.txt").write_text("the same owl")
    cfg = SourceConfig(uri=str(src), folder_partitions=1)
    (part,) = list_partitions(cfg)
    items = list(read_partition(part, cfg))
    assert count_by_reason(items) == {"good": 2, "link_outside_source": 2}
    assert all("hunter2" not in (i.caption or "") for i in items if isinstance(i, RawSample))
