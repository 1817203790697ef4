"""encode.sources: listing (formats, patterns, ids, fingerprints); reading hostile input without crashing."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import shutil
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from encode import sample_data
from encode.config import SourceConfig
from encode.sources import (
    Partition,
    RawSample,
    Rejected,
    SourceError,
    count_by_reason,
    list_partitions,
    partition_id,
    read_partition,
    read_webdataset,
)
from shared import storage
from tests.builders import hostile

PER_SHARD = 8


@pytest.fixture(scope="module")
def wds_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """img2dataset webdataset output: 2 tars (+ metadata parquet and stats files next to them)."""
    out = tmp_path_factory.mktemp("wds")
    sample_data.build_webdataset(out, shards=2, per_shard=PER_SHARD)
    return out


def read_all(partition: Partition, cfg: SourceConfig) -> list[RawSample | Rejected]:
    return list(read_partition(partition, cfg))


def good_keys(items: list[RawSample | Rejected]) -> list[str]:
    return [item.key for item in items if isinstance(item, RawSample)]


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def small_members(count: int) -> list[tuple[str, bytes]]:
    """`count` tiny but complete samples (the bytes need not be real images for the reader)."""
    members = []
    for index in range(count):
        key = f"{index:09d}"
        members += [(f"{key}.jpg", b"\xff\xd8" + bytes([index]) * 700), (f"{key}.json", b'{"i": %d}' % index)]
        members.append((f"{key}.txt", f"caption {index}".encode()))
    return members


# ------------------------------------------------------------------------------------------- listing
def test_webdataset_folder_lists_tars_not_metadata_parquet(wds_dir: Path) -> None:
    cfg = SourceConfig(uri=str(wds_dir))
    parts = list_partitions(cfg)
    assert [p.id for p in parts] == ["00000-tar", "00001-tar"]
    assert all(p.kind == "webdataset" and len(p.uris) == 1 for p in parts)
    assert parts == list_partitions(cfg)  # deterministic


def test_webdataset_reads_every_sample_in_tar_order(wds_dir: Path) -> None:
    cfg = SourceConfig(uri=str(wds_dir))
    items = read_all(list_partitions(cfg)[1], cfg)
    assert all(isinstance(item, RawSample) for item in items)
    keys = good_keys(items)
    assert len(keys) == PER_SHARD and keys == sorted(keys) and all(k.startswith("00001") for k in keys)
    first = items[0]
    assert isinstance(first, RawSample) and first.image[:2] == b"\xff\xd8"
    assert first.caption == first.meta["caption"] and first.meta["key"] == first.key
    assert {"url", "punsafe", "pwatermark", "similarity", "width", "height"} <= set(first.meta)


def test_brace_range_and_glob(wds_dir: Path) -> None:
    braces = list_partitions(SourceConfig(uri=f"{wds_dir}/{{00000..00001}}.tar"))
    glob = list_partitions(SourceConfig(uri=f"{wds_dir}/*.tar"))
    assert [p.id for p in braces] == [p.id for p in glob] == ["00000-tar", "00001-tar"]
    single = list_partitions(SourceConfig(uri=f"{wds_dir}/00001.tar"))
    assert [p.id for p in single] == ["00001-tar"]


def test_brace_range_with_missing_members_names_them(wds_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"2 file\(s\).*00002\.tar.*00003\.tar.*brace range"):
        list_partitions(SourceConfig(uri=f"{wds_dir}/{{00000..00003}}.tar"))


def test_empty_glob_and_missing_folder_are_errors(wds_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"\*\.nothing matches no files"):
        list_partitions(SourceConfig(uri=f"{wds_dir}/*.nothing"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_partitions(SourceConfig(uri=str(tmp_path / "absent")))


def test_unknown_content_and_wrong_format_are_errors(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("hi")
    with pytest.raises(SourceError, match=r"set source\.format"):
        list_partitions(SourceConfig(uri=str(tmp_path)))
    with pytest.raises(SourceError, match="no parquet input files"):
        list_partitions(SourceConfig(uri=str(tmp_path), format="parquet"))


def test_nested_ids_are_unique_and_include_the_relative_dir(wds_dir: Path, tmp_path: Path) -> None:
    for sub in ("a/b", "a-b", "c"):
        (tmp_path / sub).mkdir(parents=True)
        shutil.copy(wds_dir / "00001.tar", tmp_path / sub / "00001.tar")
    (tmp_path / ".hidden").mkdir()
    shutil.copy(wds_dir / "00001.tar", tmp_path / ".hidden" / "00009.tar")
    ids = [p.id for p in list_partitions(SourceConfig(uri=str(tmp_path)))]
    assert len(ids) == 3 and len(set(ids)) == 3 and ids == sorted(ids)
    assert "c-00001-tar" in ids
    assert all(i.startswith("a-b-00001-tar-") for i in ids if i != "c-00001-tar")  # collision: hashed
    assert not any("00009" in i for i in ids)  # dot folders are not input


def test_partition_id_is_safe() -> None:
    assert partition_id("00000.tar") == "00000-tar"
    assert partition_id("a/b/00001.parquet") == "a-b-00001-parquet"
    odd = partition_id("weird name/ü?.tar")
    assert odd.replace("-", "").replace("_", "").isalnum() and odd != partition_id("weird name/u?.tar")
    assert len(partition_id("x" * 500 + ".tar")) <= 120


def test_max_partitions(wds_dir: Path) -> None:
    assert [p.id for p in list_partitions(SourceConfig(uri=str(wds_dir), max_partitions=1))] == ["00000-tar"]


def test_fingerprint_changes_only_with_the_bytes(wds_dir: Path, tmp_path: Path) -> None:
    for name in ("00000.tar", "00001.tar"):
        shutil.copy(wds_dir / name, tmp_path / name)
    cfg = SourceConfig(uri=str(tmp_path))
    before = {p.id: p.source_fingerprint() for p in list_partitions(cfg)}
    assert before == {p.id: p.source_fingerprint() for p in list_partitions(cfg)}
    unlisted = Partition("00000-tar", "webdataset", (str(tmp_path / "00000.tar"),))
    assert unlisted.source_fingerprint() == before["00000-tar"]  # stats the file itself
    data = (tmp_path / "00001.tar").read_bytes()
    (tmp_path / "00001.tar").write_bytes(data[:-1024])
    after = {p.id: p.source_fingerprint() for p in list_partitions(cfg)}
    assert after["00000-tar"] == before["00000-tar"] and after["00001-tar"] != before["00001-tar"]


def test_partitions_and_samples_pickle(wds_dir: Path) -> None:
    cfg = SourceConfig(uri=str(wds_dir))
    part = list_partitions(cfg)[0]
    clone = pickle.loads(pickle.dumps(part))
    assert clone == part and clone.source_fingerprint() == part.source_fingerprint()
    item = next(read_partition(part, cfg))
    assert pickle.loads(pickle.dumps(item)) == item


# ---------------------------------------------------------------------------------- hostile webdataset
def test_hostile_tar_reader_level_reasons(tmp_path: Path) -> None:
    expected = hostile.build_hostile_webdataset(tmp_path / "hostile.tar")
    cfg = SourceConfig(uri=str(tmp_path / "hostile.tar"))
    counts = count_by_reason(read_all(list_partitions(cfg)[0], cfg))
    reader_reasons = (
        "empty_image_file",
        "missing_image",
        "missing_caption",
        "caption_not_utf8",
        "unsafe_member_name",
        "duplicate_key",
        "corrupt_tar",
    )
    for reason in reader_reasons:
        assert counts[reason] == expected[reason], reason
    # everything else is yielded as a sample for images.py / filters.py to judge
    assert counts["good"] == sum(n for r, n in expected.items() if r not in reader_reasons)


def test_truncated_tar_never_raises_and_yields_a_prefix(tmp_path: Path) -> None:
    path = tmp_path / "t.tar"
    full = write_tar(path, small_members(4))
    all_keys = good_keys(list(read_webdataset(str(path), SourceConfig())))
    assert len(all_keys) == 4
    for cut in range(0, len(full), 256):
        path.write_bytes(full[:cut])
        items = list(read_webdataset(str(path), SourceConfig()))
        keys = good_keys(items)
        assert keys == all_keys[: len(keys)], cut
        complete_without_end_blocks = cut >= len(full) - 2 * tarfile.BLOCKSIZE - 8192
        if not complete_without_end_blocks:
            assert isinstance(items[-1], Rejected) and items[-1].reason == "corrupt_tar", cut
            assert sum(isinstance(i, Rejected) for i in items) == 1, cut


def test_a_damaged_header_mid_tar_loses_its_samples_only_and_counts_them(tmp_path: Path) -> None:
    """tarfile ends a tar at a bad header: every later sample (and the one being read) was lost, uncounted.
    Now it steps over to the next valid header; the sample whose member was damaged and the next one go,
    counted (either may have lost its .json, which the metadata filters need)."""
    members = small_members(6)
    full = bytearray(write_tar(tmp_path / "t.tar", members))
    # sample 2's .json header: members are header + data blocks (jpg: 2 data blocks; json, txt: 1 each)
    per_sample = (1 + 2) + (1 + 1) + (1 + 1)
    header = (2 * per_sample + 3) * tarfile.BLOCKSIZE
    assert bytes(full[header : header + 16]).startswith(b"000000002.json")
    full[header + 148 : header + 156] = b"0000000\x00"  # a checksum that no longer matches
    (tmp_path / "t.tar").write_bytes(bytes(full))
    items = list(read_webdataset(str(tmp_path / "t.tar"), SourceConfig()))
    assert good_keys(items) == ["000000000", "000000001", "000000004", "000000005"]
    rejected = [(i.key, i.reason) for i in items if isinstance(i, Rejected)]
    assert rejected == [("000000002", "corrupt_tar"), ("000000003", "corrupt_tar")]


def test_garbage_and_empty_files_are_corrupt_tars(tmp_path: Path) -> None:
    (tmp_path / "garbage.tar").write_bytes(b"this is not a tar file at all" * 40)
    (tmp_path / "empty.tar").write_bytes(b"")
    for name in ("garbage.tar", "empty.tar"):
        items = list(read_webdataset(str(tmp_path / name), SourceConfig()))
        assert [(type(i), i.reason) for i in items] == [(Rejected, "corrupt_tar")]  # type: ignore[union-attr]


def test_gzipped_tar_and_corrupt_gzip(tmp_path: Path) -> None:
    raw = write_tar(tmp_path / "plain.tar", small_members(3))
    packed = gzip.compress(raw, mtime=0)
    (tmp_path / "ok.tar.gz").write_bytes(packed)
    (tmp_path / "bad.tar.gz").write_bytes(packed[: len(packed) // 2])
    parts = list_partitions(SourceConfig(uri=str(tmp_path / "*.tar.gz")))
    assert [p.id for p in parts] == ["bad-tar-gz", "ok-tar-gz"]
    ok = list(read_partition(parts[1], SourceConfig()))
    assert len(good_keys(ok)) == 3 and ok[0].caption == "caption 0"  # type: ignore[union-attr]
    bad = list(read_partition(parts[0], SourceConfig()))
    assert bad[-1].reason == "corrupt_tar"  # type: ignore[union-attr]


def test_member_names_are_normalised_and_grouped(tmp_path: Path) -> None:
    members = [
        ("./000000001.jpg", b"img1"),
        ("./000000001.TXT", b"dot-slash prefix, upper-case ext"),
        ("sub/000000002.jpg", b"img2"),
        ("sub/000000002.txt", b"in a folder"),
        ("sub/000000002.txt", b"second copy"),
        ("000000003.png", b"png"),
        ("000000003.jpg", b"jpg wins: first in image_exts"),
        ("000000003.txt", b"three"),
        (".hidden", b"no key"),
    ]
    write_tar(tmp_path / "n.tar", members)
    items = list(read_webdataset(str(tmp_path / "n.tar"), SourceConfig()))
    good = {i.key: i for i in items if isinstance(i, RawSample)}
    assert list(good) == ["000000001", "000000003"]
    assert good["000000001"].caption.startswith("dot-slash")
    assert good["000000003"].image == b"jpg wins: first in image_exts"
    assert count_by_reason(items) == {"good": 2, "duplicate_member": 1, "bad_member_name": 1}


def test_oversized_member_is_rejected_unread(tmp_path: Path) -> None:
    members = [("a.jpg", b"x" * 1001), ("a.txt", b"big"), ("b.jpg", b"x" * 998), ("b.txt", b"ok")]
    write_tar(tmp_path / "big.tar", members)
    items = list(read_webdataset(str(tmp_path / "big.tar"), SourceConfig(max_sample_bytes=1000)))
    assert [(i.key, type(i).__name__) for i in items] == [("a", "Rejected"), ("b", "RawSample")]
    assert items[0].reason == "file_too_large"  # type: ignore[union-attr]


def test_missing_tar_at_read_time_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        list(read_webdataset(str(tmp_path / "gone.tar"), SourceConfig()))


# ------------------------------------------------------------------------------------------- parquet
def test_parquet_rows_stream_by_row_group(tmp_path: Path) -> None:
    paths = sample_data.build_parquet(tmp_path, shards=1, per_shard=32)
    cfg = SourceConfig(uri=str(tmp_path))
    parts = list_partitions(cfg)
    assert [(p.id, p.kind) for p in parts] == [("00000-parquet", "parquet")]
    assert pq.ParquetFile(paths[0]).num_row_groups > 1
    items = read_all(parts[0], cfg)
    counts = count_by_reason(items)
    assert counts == {"good": 32, "missing_image": 1}  # img2dataset rows for failed downloads: no jpg
    sample = next(i for i in items if isinstance(i, RawSample))
    assert "jpg" not in sample.meta and {"NSFW", "punsafe", "url", "key"} <= set(sample.meta)
    assert sample.caption == sample.meta["caption"] and sample.image[:2] == b"\xff\xd8"


def test_parquet_hostile_rows_and_files(tmp_path: Path) -> None:
    table = pa.table(
        {
            "key": ["a", "b", "a", "c", "d", None],
            "caption": [b"ok", b"\xff\xfe", b"dup", None, b"ok", b"no key"],
            "jpg": [b"x", b"y", b"z", b"w", b"", b"v"],
        }
    )
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=2)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    cfg = SourceConfig(uri=str(tmp_path), format="parquet")
    parts = {p.id: p for p in list_partitions(cfg)}
    rows = read_all(parts["rows-parquet"], cfg)
    assert count_by_reason(rows) == {
        "good": 2,
        "caption_not_utf8": 1,
        "duplicate_key": 1,
        "missing_caption": 1,
        "empty_image_file": 1,
    }
    assert [i.key for i in rows if isinstance(i, RawSample)] == ["a", "rows-2-1"]  # keyless row: synthesised
    assert count_by_reason(read_all(parts["broken-parquet"], cfg)) == {"corrupt_parquet": 1}


def test_parquet_without_the_image_column_names_the_fix(tmp_path: Path, wds_dir: Path) -> None:
    cfg = SourceConfig(uri=str(wds_dir / "00000.parquet"))  # img2dataset's metadata-only parquet
    part = list_partitions(cfg)[0]
    with pytest.raises(SourceError, match=r"no column 'jpg'.*source.image_column"):
        read_all(part, cfg)


def test_parquet_images_as_hugging_face_structs_are_read_and_wrong_types_name_the_column(
    tmp_path: Path,
) -> None:
    """Hugging Face datasets store an Image feature as {bytes, path}; a column of another type was read
    row by row and failed the whole partition on every run with a TypeError far from the cause."""
    sample_data.build_image_folder(tmp_path / "imgs", count=2)
    images = [p.read_bytes() for p in sorted((tmp_path / "imgs").rglob("*.jpg"))]
    assert len(images) == 2
    hf = pa.table(
        {"key": ["a", "b"], "jpg": [{"bytes": b, "path": None} for b in images], "caption": ["x", "y"]}
    )
    pq.write_table(hf, tmp_path / "hf.parquet")
    cfg = SourceConfig(uri=str(tmp_path / "hf.parquet"))
    rows = read_all(list_partitions(cfg)[0], cfg)
    assert [r.image for r in rows if isinstance(r, RawSample)] == images
    for name, table, match in (
        (
            "paths",
            pa.table({"jpg": ["a.jpg"], "caption": ["x"]}),
            r"column 'jpg' is string, not encoded image",
        ),
        ("floats", pa.table({"jpg": images[:1], "caption": [1.0]}), r"column 'caption' is double, not text"),
    ):
        pq.write_table(table, tmp_path / f"{name}.parquet")
        cfg = SourceConfig(uri=str(tmp_path / f"{name}.parquet"))
        with pytest.raises(SourceError, match=match):
            read_all(list_partitions(cfg)[0], cfg)


# -------------------------------------------------------------------------------------------- folder
@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    return sample_data.build_image_folder(tmp_path / "imgs", count=24)


def test_folder_partitions_cover_every_image_once(image_folder: Path) -> None:
    cfg = SourceConfig(uri=str(image_folder), folder_partitions=4)
    parts = list_partitions(cfg)
    assert all(p.kind == "folder" and p.id.startswith("folder-000") for p in parts)
    items = [i for p in parts for i in read_all(p, cfg)]
    assert count_by_reason(items) == {"good": 24}
    keys = [i.key for i in items]
    assert len(set(keys)) == 24 and "more/shapes_0003" in keys
    for part in parts:
        part_keys = good_keys(read_all(part, cfg))
        assert part_keys == sorted(part_keys)
    with_meta = [i for i in items if isinstance(i, RawSample) and i.meta]
    assert len(with_meta) == 8 and all("punsafe" in i.meta for i in with_meta)
    assert all(isinstance(i, RawSample) and not i.caption.endswith(" ") for i in items)


def test_folder_bucketing_is_stable_when_an_image_is_added(image_folder: Path) -> None:
    cfg = SourceConfig(uri=str(image_folder), folder_partitions=4)
    before = {p.id: p.source_fingerprint() for p in list_partitions(cfg)}
    shutil.copy(image_folder / "shapes_0000.jpg", image_folder / "added.jpg")
    (image_folder / "added.txt").write_text("a red circle on a blue background")
    after = {p.id: p.source_fingerprint() for p in list_partitions(cfg)}
    changed = {pid for pid in after if before.get(pid) != after[pid]}
    assert len(changed) == 1


def test_folder_caption_edit_changes_the_fingerprint(image_folder: Path) -> None:
    cfg = SourceConfig(uri=str(image_folder), folder_partitions=4)
    before = {p.id: p.source_fingerprint() for p in list_partitions(cfg)}
    caption = image_folder / "shapes_0001.txt"
    caption.write_text("a changed caption")
    os.utime(caption, ns=(1, 1))  # a different mtime even on coarse-timestamp filesystems
    after = {p.id: p.source_fingerprint() for p in list_partitions(cfg)}
    assert sum(before[pid] != after[pid] for pid in after) == 1


def test_folder_missing_caption_duplicate_stem_and_hidden_files(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(b"jpg")
    (tmp_path / "a.png").write_bytes(b"png")
    (tmp_path / "a.txt").write_text("shared caption")
    (tmp_path / "b.jpg").write_bytes(b"jpg")  # no caption
    (tmp_path / "c.webp").write_bytes(b"")  # empty file
    (tmp_path / "c.txt").write_text("c")
    (tmp_path / "._a.jpg").write_bytes(b"macOS resource fork")
    cfg = SourceConfig(uri=str(tmp_path), folder_partitions=1)
    parts = list_partitions(cfg)
    assert [p.id for p in parts] == ["folder-0000"]
    items = read_all(parts[0], cfg)
    assert count_by_reason(items) == {
        "good": 1,
        "duplicate_key": 1,
        "missing_caption": 1,
        "empty_image_file": 1,
    }
    assert items[0].image == b"jpg"  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------------ S3
@pytest.mark.s3
def test_s3_webdataset_and_parquet_match_local(wds_dir: Path, tmp_path: Path, s3_prefix: str) -> None:
    for name in ("00000.tar", "00001.tar"):
        storage.write_bytes(f"{s3_prefix}/wds/{name}", (wds_dir / name).read_bytes())
    cfg = SourceConfig(uri=f"{s3_prefix}/wds/{{00000..00001}}.tar")
    parts = list_partitions(cfg)
    assert [p.id for p in parts] == ["00000-tar", "00001-tar"]
    local_cfg = SourceConfig(uri=str(wds_dir))
    local = read_all(list_partitions(local_cfg)[1], local_cfg)
    assert read_all(parts[1], cfg) == local
    assert (
        parts[1].source_fingerprint()
        == Partition(parts[1].id, "webdataset", parts[1].uris).source_fingerprint()
    )
    with pytest.raises(FileNotFoundError, match=r"00002\.tar"):
        list_partitions(SourceConfig(uri=f"{s3_prefix}/wds/{{00000..00002}}.tar"))
    glob = list_partitions(SourceConfig(uri=f"{s3_prefix}/wds/*.tar"))
    assert [p.id for p in glob] == ["00000-tar", "00001-tar"]

    sample_data.build_parquet(tmp_path, shards=1, per_shard=8)
    storage.write_bytes(f"{s3_prefix}/pq/00000.parquet", (tmp_path / "00000.parquet").read_bytes())
    pq_cfg = SourceConfig(uri=f"{s3_prefix}/pq")
    pq_parts = list_partitions(pq_cfg)
    assert [p.id for p in pq_parts] == ["00000-parquet"]
    assert count_by_reason(read_all(pq_parts[0], pq_cfg)) == {"good": 8}


def test_a_folder_file_name_that_is_not_utf8_is_listed_and_its_sample_rejected(tmp_path: Path) -> None:
    """Listing hashed each key with str.encode(): one latin-1 file name stopped the whole job."""
    from encode.process.prepare import key_is_utf8

    name = os.fsdecode(b"caf\xe9")  # what Python makes of a non-UTF-8 name: a surrogate
    (tmp_path / f"{name}.jpg").write_bytes(b"x")
    (tmp_path / f"{name}.txt").write_bytes(b"a caption")
    cfg = SourceConfig(uri=str(tmp_path), format="folder")
    [sample] = [i for p in list_partitions(cfg) for i in read_all(p, cfg) if isinstance(i, RawSample)]
    assert not key_is_utf8(sample.key) and key_is_utf8("café")
