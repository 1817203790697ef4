"""The encode job end to end on the tiny preset: real sample data in, real MDS out, read back with streaming.

Most tests call the library (`run_rank` + `publish`) with one shared set of tiny encoders, which counts
every caption and image that went through a model: that is how "only X was recomputed" is verified.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from encode import pipeline
from encode.config import EncodeConfig
from encode.pipeline import RankInfo, RankSummary, run_rank
from encode.plan.reuse import iter_mds_rows
from encode.process.encoders import Encoders, load_encoders
from encode.process.prepare import PartitionEnd, PreparedBatch, PreparedSample, batch_partition
from encode.publish.finalize import NotFinishedError, PublishResult, publish
from encode.publish.gc import collect_garbage
from encode.sample_data import build_parquet, build_webdataset
from encode.sources import list_partitions
from shared import contract, storage
from shared.config import load_config
from shared.manifest import Layout, read_manifest
from tests.builders.hostile import build_hostile_webdataset
from tests.builders.streaming import plain_streaming_dataset

SHARDS, PER_SHARD = 3, 24
# Smaller than sample.yaml's 64/128 px so the VAE work per test is 4x less; the logic is the same.
LOW, HIGH = 32, 64
SMALL = [f"filter.min_size={LOW}", f"transform.resolutions=[{LOW},{HIGH}]"]


def make_cfg(source: str | Path, output: str | Path, *overrides: str) -> EncodeConfig:
    base = [f"source.uri={source}", f"output.uri={output}", "workers=1", "progress=false", *SMALL]
    return load_config(EncodeConfig, "sample", [*base, *overrides], kind="datasets")


@pytest.fixture(scope="module")
def encoders() -> Encoders:
    return load_encoders(make_cfg("unused", "unused"))


@pytest.fixture(scope="module")
def wds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wds")
    build_webdataset(out, shards=SHARDS, per_shard=PER_SHARD, seed=3)
    return out


def encode(cfg: EncodeConfig, encoders: Encoders, ranks: int = 1) -> tuple[list[RankSummary], PublishResult]:
    encoders.texts_encoded = encoders.images_encoded = 0
    summaries = [run_rank(cfg, RankInfo(rank, ranks), encoders) for rank in range(ranks)]
    return summaries, publish(cfg, encoders)


def rows_by_key(root: str | Path, resolution: int, version: str | None = None) -> dict[str, dict]:
    """Every row of one resolution of a published version, read through its partition folders."""
    manifest = read_manifest(str(root), version)
    layout = Layout(str(root))
    rows: dict[str, dict] = {}
    for part in manifest.partitions:
        dirname = part["dirs"].get(str(resolution))
        if not dirname:
            continue
        for row in iter_mds_rows(layout.partition_output(resolution, dirname)):
            assert row[contract.KEY] not in rows, f"duplicate key {row[contract.KEY]}"
            rows[row[contract.KEY]] = row
    return rows


def test_webdataset_end_to_end(wds: Path, tmp_path: Path, encoders: Encoders) -> None:
    cfg = make_cfg(wds, tmp_path / "out")
    (summary,), result = encode(cfg, encoders)
    manifest = result.manifest
    assert result.new_version and summary.partitions_total == SHARDS
    assert manifest.samples_read == SHARDS * PER_SHARD
    assert manifest.rejected, "the sample data holds samples the default filters drop"
    kept = manifest.resolutions[LOW].num_samples
    assert kept + sum(manifest.rejected.values()) == manifest.samples_read
    for res, info in manifest.resolutions.items():
        rows = rows_by_key(tmp_path / "out", res)
        assert len(rows) == info.num_samples > 0
        row = next(iter(rows.values()))
        assert row[contract.LATENT_MEAN].shape == encoders.preset.latent_shape(res)
        assert row[contract.LATENT_MEAN].dtype == np.float16
        assert row[contract.TEXT_EMBEDDING].shape == encoders.preset.text_shape()
    # Images below HIGH px are absent at HIGH (never upscaled), present at LOW.
    assert manifest.resolutions[HIGH].num_samples + manifest.resolutions[HIGH].smaller_than_resolution == kept
    assert manifest.scale_factor == encoders.vae.config.scaling_factor
    assert manifest.empty_caption_embedding.shape == encoders.preset.text_shape()
    assert manifest.fingerprints["encoders"]["vae"] == encoders.ids.vae
    assert storage.exists(str(tmp_path / "out" / "metrics.json"))


def test_a_sample_too_small_for_every_resolution_is_not_text_encoded(
    wds: Path, tmp_path: Path, encoders: Encoders
) -> None:
    """filter.min_size below every resolution: the samples between them fit none and go nowhere, so their
    captions must not go through the text tower either (nothing stores them: every rerun would redo it)."""
    cfg = make_cfg(wds, tmp_path / "out", "filter.min_size=8", f"transform.resolutions=[{HIGH}]")
    _, result = encode(cfg, encoders)
    info = result.manifest.resolutions[HIGH]
    assert info.smaller_than_resolution > 0, "the sample data has images below HIGH px"
    assert encoders.texts_encoded == info.num_samples


def test_a_failed_upload_leaves_no_staged_shards(
    wds: Path, tmp_path: Path, encoders: Encoders, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An S3 outage or AccessDenied mid-job: up to max_pending_uploads + 1 partitions of staged shards
    stayed in the temp folder until the same job was rerun (the rerun redoes them anyway)."""
    from encode.process import writer as writer_module
    from shared.storage import StorageError

    def refuse(local: Path, uri: str) -> None:
        raise StorageError(f"S3 request for {uri} failed: AccessDenied")

    monkeypatch.setattr(writer_module, "_put_in_place", refuse)
    out = tmp_path / "out"
    with pytest.raises(StorageError, match="AccessDenied"):
        encode(make_cfg(wds, out, "output.max_pending_uploads=2"), encoders)
    staging = writer_module.staging_root(Layout(str(out)))
    assert not staging.exists() or not list(staging.iterdir())


def test_a_source_config_that_does_not_fit_the_files_stops_the_job_on_its_line(
    wds: Path, tmp_path: Path, encoders: Encoders
) -> None:
    """img2dataset's metadata-only parquet read as the images: every partition failed 'rerun to retry'
    under a traceback, for a setting no rerun changes."""
    from encode.sources import SourceError

    cfg = make_cfg(wds / "00000.parquet", tmp_path / "out", "source.format=parquet")
    with pytest.raises(SourceError, match=r"no column 'jpg'.*source.image_column"):
        encode(cfg, encoders)


def test_merged_index_streams_with_streaming(wds: Path, tmp_path: Path, encoders: Encoders) -> None:
    cfg = make_cfg(wds, tmp_path / "out")
    _, result = encode(cfg, encoders)
    layout = Layout(str(tmp_path / "out"))
    dataset = plain_streaming_dataset(
        remote=layout.stream_root(LOW), local=str(tmp_path / "cache"), shuffle=False
    )
    keys = {dataset[i][contract.KEY] for i in range(len(dataset))}
    assert len(keys) == len(dataset) == result.manifest.resolutions[LOW].num_samples
    assert keys == set(rows_by_key(tmp_path / "out", LOW))


def test_rerun_is_up_to_date_and_encodes_nothing(wds: Path, tmp_path: Path, encoders: Encoders) -> None:
    cfg = make_cfg(wds, tmp_path / "out")
    _, first = encode(cfg, encoders)
    (summary,), second = encode(cfg, encoders)
    assert (encoders.texts_encoded, encoders.images_encoded) == (0, 0)
    assert summary.partitions_done_before == SHARDS and not summary.markers
    assert not second.new_version and second.manifest.version == first.manifest.version


def test_another_spelling_of_the_source_path_is_up_to_date(
    wds: Path, tmp_path: Path, encoders: Encoders, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    _, first = encode(make_cfg(wds, out), encoders)
    monkeypatch.chdir(tmp_path)
    relative = os.path.relpath(wds, tmp_path) + "/./"
    (summary,), second = encode(make_cfg(relative, out), encoders)
    assert (encoders.texts_encoded, encoders.images_encoded) == (0, 0)
    assert summary.partitions_done_before == SHARDS and second.manifest.version == first.manifest.version


def test_caption_change_recomputes_only_text(wds: Path, tmp_path: Path, encoders: Encoders) -> None:
    out = tmp_path / "out"
    _, before = encode(make_cfg(wds, out), encoders)
    _, after = encode(make_cfg(wds, out, "caption.max_chars=12"), encoders)
    assert encoders.images_encoded == 0, "latents must be reused when only caption logic changed"
    assert encoders.texts_encoded == after.manifest.resolutions[LOW].num_samples
    old, new = rows_by_key(out, HIGH, before.manifest.version), rows_by_key(out, HIGH)
    assert old.keys() == new.keys()
    for key in old:
        assert old[key][contract.LATENT_MEAN].tobytes() == new[key][contract.LATENT_MEAN].tobytes()
        assert old[key][contract.LATENT_LOGVAR].tobytes() == new[key][contract.LATENT_LOGVAR].tobytes()
    assert any(
        old[k][contract.TEXT_EMBEDDING].tobytes() != new[k][contract.TEXT_EMBEDDING].tobytes() for k in old
    )


def test_reuse_of_compressed_shards_leaves_the_published_folders_as_they_were(
    wds: Path, tmp_path: Path, encoders: Encoders
) -> None:
    """A rerun reads earlier zstd shards decompressed in a folder of its own: it wrote raw copies into the
    published version's folders (twice their bytes, and a half-written one broke that version's readers)."""
    out = tmp_path / "out"
    encode(make_cfg(wds, out, "output.compression=zstd"), encoders)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*.mds*") if "versions" not in p.parts)
    assert before and all(name.endswith(".zstd") for name in before)
    encode(make_cfg(wds, out, "output.compression=zstd", "caption.max_chars=12"), encoders)
    assert encoders.images_encoded == 0, "latents are reused from the compressed shards"
    after = {str(p.relative_to(out)) for p in out.rglob("*.mds*")}
    assert set(before) <= after and not any(name.endswith(".mds") for name in after)


def test_image_change_recomputes_only_latents(wds: Path, tmp_path: Path, encoders: Encoders) -> None:
    out = tmp_path / "out"
    _, before = encode(make_cfg(wds, out), encoders)
    _, after = encode(make_cfg(wds, out, "transform.resample=bilinear"), encoders)
    assert encoders.texts_encoded == 0, "text embeddings must be reused when only image logic changed"
    rows = sum(info.num_samples for info in after.manifest.resolutions.values())
    assert encoders.images_encoded == rows
    old, new = rows_by_key(out, LOW, before.manifest.version), rows_by_key(out, LOW)
    assert old.keys() == new.keys()
    for key in old:
        assert old[key][contract.TEXT_EMBEDDING].tobytes() == new[key][contract.TEXT_EMBEDDING].tobytes()


def test_inference_precision_is_part_of_what_was_encoded(
    wds: Path, tmp_path: Path, encoders: Encoders
) -> None:
    """encoder.precision changes both towers' outputs on a GPU, low-precision norms the VAE's: either redoes
    what it changes (a CPU computes fp32 whatever is set, so this counts the decisions, not the values)."""
    out = tmp_path / "out"
    encode(make_cfg(wds, out), encoders)
    _, bf16 = encode(make_cfg(wds, out, "encoder.precision=bf16"), encoders)
    rows = sum(info.num_samples for info in bf16.manifest.resolutions.values())
    assert encoders.texts_encoded == bf16.manifest.resolutions[LOW].num_samples
    assert encoders.images_encoded == rows
    encode(make_cfg(wds, out, "encoder.precision=bf16", "encoder.low_precision_norms=true"), encoders)
    assert (encoders.texts_encoded, encoders.images_encoded) == (0, rows)


def test_new_resolution_encodes_only_that_resolution(wds: Path, tmp_path: Path, encoders: Encoders) -> None:
    out = tmp_path / "out"
    _, before = encode(make_cfg(wds, out, f"transform.resolutions=[{LOW}]"), encoders)
    folders = Path(Layout(str(out)).stream_root(LOW))
    published = {p.name: p.stat().st_ino for p in folders.iterdir() if p.is_dir()}
    _, after = encode(make_cfg(wds, out, f"transform.resolutions=[{LOW},{HIGH}]"), encoders)
    assert encoders.texts_encoded == 0
    assert encoders.images_encoded == after.manifest.resolutions[HIGH].num_samples
    # The low resolution's outputs keep their names, and their folders stay as they were: replacing one
    # deleted it first, under the trainers of the version that publishes it.
    assert [p["dirs"][str(LOW)] for p in after.manifest.partitions] == [
        p["dirs"][str(LOW)] for p in before.manifest.partitions
    ]
    for name, inode in published.items():
        assert (folders / name).stat().st_ino == inode, name


def test_filter_change_encodes_only_newly_admitted(wds: Path, tmp_path: Path, encoders: Encoders) -> None:
    out = tmp_path / "out"
    _, strict = encode(make_cfg(wds, out, "filter.max_punsafe=0.01", "filter.max_pwatermark=0.2"), encoders)
    _, loose = encode(make_cfg(wds, out), encoders)
    added = {
        res: loose.manifest.resolutions[res].num_samples - strict.manifest.resolutions[res].num_samples
        for res in (LOW, HIGH)
    }
    assert added[LOW] > 0
    assert encoders.images_encoded == sum(added.values())
    assert encoders.texts_encoded == added[LOW]
    # Tightening again removes rows without encoding anything.
    _, again = encode(make_cfg(wds, out, "filter.max_punsafe=0.01", "filter.max_pwatermark=0.2"), encoders)
    assert (encoders.texts_encoded, encoders.images_encoded) == (0, 0)
    assert again.manifest.resolutions[LOW].num_samples == strict.manifest.resolutions[LOW].num_samples


def test_old_version_stays_readable_until_gc(wds: Path, tmp_path: Path, encoders: Encoders) -> None:
    out = tmp_path / "out"
    _, v1 = encode(make_cfg(wds, out), encoders)
    _, v2 = encode(make_cfg(wds, out, "transform.resample=bilinear"), encoders)
    assert v1.manifest.version != v2.manifest.version
    assert len(rows_by_key(out, LOW, v1.manifest.version)) == v1.manifest.resolutions[LOW].num_samples
    report = collect_garbage(Layout(str(out)), keep=1)
    assert report.deleted_versions == [v1.manifest.version]
    assert report.deleted_partition_dirs
    with pytest.raises(FileNotFoundError):
        read_manifest(str(out), v1.manifest.version)
    assert len(rows_by_key(out, LOW)) == v2.manifest.resolutions[LOW].num_samples
    # Reuse still works after gc: the current outputs are the source now.
    encode(make_cfg(wds, out, "transform.resample=bilinear", "caption.max_chars=12"), encoders)
    assert encoders.images_encoded == 0


def test_gc_deletes_a_dropped_resolution_and_its_root_index(
    wds: Path, tmp_path: Path, encoders: Encoders
) -> None:
    out = tmp_path / "out"
    encode(make_cfg(wds, out), encoders)
    _, low_only = encode(make_cfg(wds, out, f"transform.resolutions=[{LOW}]"), encoders)
    layout = Layout(str(out))
    assert storage.exists(layout.current_index(HIGH))
    report = collect_garbage(layout, keep=1)
    assert any(name.startswith(f"{HIGH}/") for name in report.deleted_partition_dirs)
    assert not storage.list_files(layout.stream_root(HIGH)), "the dropped resolution left files behind"
    assert len(rows_by_key(out, LOW)) == low_only.manifest.resolutions[LOW].num_samples


def test_two_ranks_make_the_same_dataset_as_one(wds: Path, tmp_path: Path, encoders: Encoders) -> None:
    encode(make_cfg(wds, tmp_path / "one"), encoders, ranks=1)
    encode(make_cfg(wds, tmp_path / "two"), encoders, ranks=2)
    for res in (LOW, HIGH):
        one, two = rows_by_key(tmp_path / "one", res), rows_by_key(tmp_path / "two", res)
        assert one.keys() == two.keys()
        for key, row in one.items():
            for column in (contract.LATENT_MEAN, contract.LATENT_LOGVAR, contract.TEXT_EMBEDDING):
                assert row[column].tobytes() == two[key][column].tobytes()


def test_batches_queued_ahead_write_the_same_rows_in_input_order(
    wds: Path, tmp_path: Path, encoders: Encoders, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of 5 from 2 workers at once: up to IN_FLIGHT_BATCHES are queued on the device ahead of the
    one being written, batches of different partitions interleave, and each partition still publishes
    only after all of its rows are written, in input order, the same bytes as one batch at a time."""
    events: list[tuple[str, int]] = []
    launch, write = pipeline.launch_batch, pipeline.LaunchedBatch.write

    def logged_launch(*args: object, **kwargs: object) -> pipeline.LaunchedBatch:
        batch = launch(*args, **kwargs)  # type: ignore[arg-type]
        events.append(("launch", id(batch)))
        return batch

    def logged_write(self: pipeline.LaunchedBatch, times: pipeline.MainThreadTimes) -> None:
        events.append(("write", id(self)))
        write(self, times)

    monkeypatch.setattr(pipeline, "launch_batch", logged_launch)
    monkeypatch.setattr(pipeline.LaunchedBatch, "write", logged_write)
    (queued,), _ = encode(make_cfg(wds, tmp_path / "queued", "workers=2", "encoder.batch_size=5"), encoders)
    ahead, queued_events = pipeline.IN_FLIGHT_BATCHES, list(events)
    monkeypatch.setattr(pipeline, "IN_FLIGHT_BATCHES", 0)
    encode(make_cfg(wds, tmp_path / "serial", "workers=0", "encoder.batch_size=5"), encoders)

    depth = deepest = 0
    for kind, _ in queued_events:
        depth += 1 if kind == "launch" else -1
        deepest = max(deepest, depth)
    assert ahead >= 2 and deepest == ahead + 1
    assert set(queued.main_thread) == set(pipeline.MainThreadTimes.PHASES)
    assert 0 < sum(queued.main_thread.values()) <= queued.seconds
    assert set(queued.main_thread_launch) == set(pipeline.MainThreadTimes.LAUNCH_PARTS)
    assert 0 < sum(queued.main_thread_launch.values()) <= queued.main_thread["launch"]
    # on CPU the models run inside their calls: the device's busy time is the calls' (DeviceTimeline)
    parts = queued.main_thread_launch
    assert 0 < queued.device["busy"] <= parts["text"] + parts["vae"]
    assert queued.device["idle"] >= 0 and sum(queued.device.values()) <= queued.seconds
    for res in (LOW, HIGH):
        rows, serial = rows_by_key(tmp_path / "queued", res), rows_by_key(tmp_path / "serial", res)
        assert list(rows) == sorted(rows) and list(serial) == sorted(serial)  # input order (keys ascend)
        assert rows.keys() == serial.keys()
        for key, row in rows.items():
            for column in (contract.LATENT_MEAN, contract.LATENT_LOGVAR, contract.TEXT_EMBEDDING):
                assert row[column].tobytes() == serial[key][column].tobytes()


def test_batches_never_span_a_partition_and_a_failed_one_drops_its_short_batch() -> None:
    def samples(partition: str, n: int) -> list[PreparedSample]:
        return [PreparedSample(partition, f"{partition}-{i}", "c", "c", None) for i in range(n)]

    done = batch_partition([*samples("a", 7), PartitionEnd("a")], size=3)
    assert [(type(b).__name__, len(getattr(b, "samples", []))) for b in done] == [
        ("PreparedBatch", 3),
        ("PreparedBatch", 3),
        ("PreparedBatch", 1),
        ("PartitionEnd", 0),
    ]
    failed = list(batch_partition([*samples("b", 4), PartitionEnd("b", error="gone")], size=3))
    assert [len(b.samples) for b in failed if isinstance(b, PreparedBatch)] == [3]
    assert isinstance(failed[-1], PartitionEnd) and failed[-1].error == "gone"


def test_rerun_with_another_rank_count_reuses_finished_partitions(
    wds: Path, tmp_path: Path, encoders: Encoders
) -> None:
    cfg = make_cfg(wds, tmp_path / "out")
    encoders.texts_encoded = encoders.images_encoded = 0
    run_rank(cfg, RankInfo(0, 2), encoders)  # rank 1 of 2 never ran: its partitions are missing
    with pytest.raises(NotFinishedError, match="not encoded"):
        publish(cfg, encoders)
    done_before = encoders.images_encoded
    (summary,), result = encode(cfg, encoders, ranks=1)
    assert summary.partitions_done_before == 2  # partitions 0 and 2 of 3 came from the 2-rank run
    assert 0 < encoders.images_encoded < done_before + result.manifest.resolutions[LOW].num_samples


def test_hostile_shard_keeps_every_good_sample(tmp_path: Path, encoders: Encoders) -> None:
    expected = build_hostile_webdataset(tmp_path / "in" / "hostile.tar")
    cfg = make_cfg(tmp_path / "in", tmp_path / "out", "filter.min_size=256", f"transform.resolutions=[{LOW}]")
    (summary,), result = encode(cfg, encoders)
    assert not summary.failed
    manifest = result.manifest
    assert manifest.resolutions[LOW].num_samples == expected.pop("good")
    assert manifest.rejected == expected


def test_parquet_source(tmp_path: Path, encoders: Encoders) -> None:
    build_parquet(tmp_path / "in", shards=2, per_shard=20)
    (summary,), result = encode(
        make_cfg(tmp_path / "in", tmp_path / "out", "source.format=parquet"), encoders
    )
    assert summary.partitions_total == 2
    assert result.manifest.samples_read == 40
    assert result.manifest.resolutions[LOW].num_samples > 0


def test_failed_partition_is_retried_not_marked_done(wds: Path, tmp_path: Path, encoders: Encoders) -> None:
    src = tmp_path / "in"
    shutil.copytree(wds, src)
    cfg = make_cfg(src, tmp_path / "out")
    partitions = list_partitions(cfg.source)
    victim = sorted(src.glob("*.tar"))[1]
    shutil.move(victim, tmp_path / "aside.tar")  # gone after listing: not the data's fault, so retry later
    summary = run_rank(cfg, RankInfo(0, 1), encoders, partitions)
    assert list(summary.failed) == ["00001-tar"]
    assert len(summary.markers) == SHARDS - 1
    shutil.move(tmp_path / "aside.tar", victim)  # same bytes and mtime: the same source fingerprint
    (summary,), result = encode(cfg, encoders)
    assert [m.partition for m in summary.markers] == ["00001-tar"]
    assert result.manifest.samples_read == SHARDS * PER_SHARD


@pytest.mark.s3
def test_s3_source_and_output(wds: Path, s3_prefix: str, encoders: Encoders) -> None:
    storage.upload_dir(_copy(wds), storage.join(s3_prefix, "in"))
    out = storage.join(s3_prefix, "out")
    cfg = make_cfg(storage.join(s3_prefix, "in"), out)
    _, first = encode(cfg, encoders)
    assert first.manifest.samples_read == SHARDS * PER_SHARD
    rows = first.manifest.resolutions[LOW].num_samples
    _, again = encode(cfg, encoders)
    assert not again.new_version and encoders.images_encoded == 0
    _, changed = encode(make_cfg(storage.join(s3_prefix, "in"), out, "caption.max_chars=12"), encoders)
    assert encoders.images_encoded == 0 and encoders.texts_encoded == rows
    assert changed.manifest.resolutions[LOW].num_samples == rows


def _copy(folder: Path) -> Path:
    """upload_dir moves a local folder into place only for local targets; for S3 it copies, but be safe."""
    target = folder.parent / f"{folder.name}-upload"
    if not target.exists():
        shutil.copytree(folder, target)
    return target
