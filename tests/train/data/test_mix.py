"""data.streams: config rules, per-stream contract checks, Streaming's weighting arithmetic, per-stream sample
counts, the mix fingerprint (refusal and allow_dataset_change), phase handoff and the dry-run plan lines.

Two tiny datasets mixed (`tiny_dataset`: 64 rows, `tiny_dataset_b`: 32 rows). Resumes across kills and rank
counts: tests/train/checkpoints/test_resume_mix.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from shared.config import ConfigError, load_config
from shared.contract import ContractError
from shared.manifest import read_manifest
from tests.train.conftest import (
    single_threaded_torch,
    stream_overrides,
    tiny_config,
    write_fake_dataset,
)
from train.checkpoints.files import LATEST_NAME, read_checkpoint
from train.checkpoints.record import DatasetChangedError
from train.config import TrainConfig
from train.data.mix import check_same_encoders, epoch_counts
from train.data.stream_counts import METRIC_PREFIX
from train.loop.trainer import fit


def mix_config(save: Path, *streams: str, extra: tuple[str, ...] = (), **data: Any) -> TrainConfig:
    base = ["samples.enabled=false", *extra]
    return tiny_config(
        "", save, save.parent / f"cache-{save.name}", *stream_overrides(*streams, **data), *base
    )


def metric_rows(save: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def counts_by_step(save: Path, names: list[str]) -> dict[int, list[int]]:
    return {
        row["step"]: [row[METRIC_PREFIX + n] for n in names]
        for row in metric_rows(save)
        if METRIC_PREFIX + names[0] in row
    }


# ---------------------------------------------------------------------------------------------- config
def build(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, "tiny", ["save_folder=/tmp/x", "data.uri=", *overrides], kind="train")


def test_config_names_streams_and_refuses_what_streaming_would_refuse_mid_run() -> None:
    cfg = build(
        "data.streams=[{uri: s3://b/laion-aesthetic, proportion: 0.7}, {uri: /d/coyo/, proportion: 0.3}]"
    )
    assert [s.resolved_name() for s in cfg.data.streams] == ["laion-aesthetic", "coyo"]
    with pytest.raises(ConfigError, match=r"relative weights \(proportion: laion\) .*repeat/choose: coyo"):
        build("data.streams=[{uri: /d/laion, proportion: 0.7}, {uri: /d/coyo, repeat: 2}]")
    with pytest.raises(ConfigError, match=r"data.uri and data.streams are both set"):
        build("data.uri=/d/x", "data.streams=[{uri: /d/laion}]")
    with pytest.raises(ConfigError, match=r"data.version=v1 .*data.streams\[i\].version"):
        build("data.version=v1", "data.streams=[{uri: /d/laion}]")  # it pinned nothing
    with pytest.raises(ConfigError, match="stream laion sets proportion and choose"):
        build("data.streams=[{uri: /d/laion, proportion: 0.7, choose: 5}]")
    with pytest.raises(ConfigError, match=r"\['x'\] are used twice"):
        build("data.streams=[{uri: /a/x}, {uri: /b/x}]")
    with pytest.raises(ConfigError, match=r"data\.epoch_size"):
        build("data.streams=[{uri: /a/x, choose: 10}]", "data.epoch_size=100")
    with pytest.raises(ConfigError, match="give b a proportion too"):
        build("data.streams=[{uri: /a/a, proportion: 1}, {uri: /a/b}]")
    with pytest.raises(ConfigError, match="batching_method"):
        build("data.streams=[{uri: /a/a}]", "data.batching_method=roundrobin")


# ---------------------------------------------------------------------------------- contract per stream
def test_each_stream_is_checked_against_the_model_and_the_first_streams_encoders(
    tiny_dataset: str, tmp_path: Path
) -> None:
    from train.loop.prepare import prepare_data

    bad = tmp_path / "wide"
    write_fake_dataset(bad, n=8, latent_shape=(4, 16, 16))
    cfg = mix_config(tmp_path / "save", f"{{uri: {tiny_dataset}}}", f"{{uri: {bad}}}")
    with pytest.raises(ContractError, match=r"stream wide .*latents at 64 px are \[4, 16, 16\]"):
        prepare_data(cfg)
    good = read_manifest(tiny_dataset)
    other = dataclasses.replace(good, scale_factor=0.5)
    with pytest.raises(ContractError, match=r"stream coyo was encoded with scale factor 0\.5"):
        check_same_encoders([("laion", good), ("coyo", other)])
    other = dataclasses.replace(good, encoder=dataclasses.replace(good.identity, text_store="tokens"))
    with pytest.raises(ContractError, match="stream coyo was encoded with text store mode 'tokens'"):
        check_same_encoders([("laion", good), ("coyo", other)])


def test_epoch_counts_are_streamings_own(tiny_dataset: str, tiny_dataset_b: str, tmp_path: Path) -> None:
    """The planner's arithmetic (no Streaming) gives the per-stream epoch counts StreamingDataset derives."""
    from train.data.loader import build_dataset
    from train.data.mix import streams_to_streaming
    from train.loop.prepare import prepare_data

    mixes = {
        "proportion": (("proportion: 0.7", "proportion: 0.3"), {"epoch_size": 50}),
        "absolute": (("choose: 20", "repeat: 1.5"), {}),
        "sizes": (("", ""), {}),
    }
    for label, ((wa, wb), data) in mixes.items():
        cfg = mix_config(
            tmp_path / label,
            f"{{uri: {tiny_dataset}, name: a, {wa}}}",
            f"{{uri: {tiny_dataset_b}, name: b, {wb}}}",
            **data,
        )
        _, pinned, streams = prepare_data(cfg)
        with single_threaded_torch():
            dataset = build_dataset(cfg.data, pinned, 8, cfg.seed, streams=streams_to_streaming(streams, 60))
        weights = [s.cfg.weight() for s in streams]
        want = epoch_counts(weights, [64, 32], cfg.data.epoch_size, cfg.seed)
        assert [int(s.choose) for s in dataset.streams] == want, label
        assert dataset.epoch_size == sum(want), label
    assert epoch_counts([("choose", 20), ("repeat", 1.5)], [64, 32], None, 0) == [20, 48]


def test_every_batching_method_makes_the_batches_streaming_promises(
    tiny_dataset: str, tiny_dataset_b: str, tmp_path: Path
) -> None:
    """One epoch of a 0.75 / 0.25 mix in batches of 8 through train's loader (one rank, no workers):
    random mixes inside batches, stratified gives every batch 6 + 2, per_stream and device_per_stream
    give each batch one stream; every method hands out 72 + 24 samples."""
    from train.data.loader import build_dataloader
    from train.data.mix import streams_to_streaming
    from train.data.packing import STREAM_INDEX, unpack
    from train.loop.prepare import prepare_data

    compositions = {}
    for method in ("random", "stratified", "per_stream", "device_per_stream"):
        cfg = mix_config(
            tmp_path / method,
            f"{{uri: {tiny_dataset}, name: a, proportion: 0.75}}",
            f"{{uri: {tiny_dataset_b}, name: b, proportion: 0.25}}",
            batching_method=method, num_workers=0, epoch_size=96,
        )  # fmt: skip
        _, pinned, streams = prepare_data(cfg)
        with single_threaded_torch():
            loader = build_dataloader(
                cfg.data, pinned, 8, cfg.seed, streams=streams_to_streaming(streams, 60)
            )
            batches = [unpack(b)[STREAM_INDEX].tolist() for b in loader]
        compositions[method] = [(row.count(0), row.count(1)) for row in batches]
        assert loader.stream_taken.tolist() == [72, 24], method
        del loader
    assert set(compositions["stratified"]) == {(6, 2)}
    for method in ("per_stream", "device_per_stream"):
        assert set(compositions[method]) <= {(8, 0), (0, 8)}, method
        assert compositions[method].count((0, 8)) == 3, method
    assert any(0 < a < 8 for a, _ in compositions["random"])


# ---------------------------------------------------------------------------------- a trained mix
@pytest.fixture(scope="module")
def mix_run(tiny_dataset: str, tiny_dataset_b: str, tmp_path_factory: pytest.TempPathFactory) -> TrainConfig:
    """12 batches of 8 = one epoch of a 0.75 / 0.25 proportion mix (96 samples: 72 + 24)."""
    base = tmp_path_factory.mktemp("mix-run")
    cfg = mix_config(
        base / "save",
        f"{{uri: {tiny_dataset}, name: laion, proportion: 0.75}}",
        f"{{uri: {tiny_dataset_b}, name: coyo, proportion: 0.25}}",
        extra=("max_duration=12ba", "save_interval=6ba", "log.console_interval=3ba"),
    )
    with single_threaded_torch():
        cfg.trainer = fit(cfg)  # type: ignore[attr-defined]
    return cfg


def test_per_stream_counts_are_logged_cumulatively_and_match_streaming(mix_run: TrainConfig) -> None:
    save = Path(mix_run.save_folder)
    counts = counts_by_step(save, ["laion", "coyo"])
    assert sorted(counts) == [3, 6, 9, 12]
    for step, (a, b) in counts.items():
        assert a + b == 8 * step  # every sample counted once, on the step that trained it
    # A whole epoch: exactly the samples Streaming assigns each stream per epoch.
    assert counts[12] == epoch_counts([("proportion", 0.75), ("proportion", 0.25)], [64, 32], None, 17)
    assert counts[12] == [72, 24]
    assert counts[3][0] > counts[3][1]


def test_a_proportion_mix_resumed_mid_epoch_matches_the_uninterrupted_run(
    mix_run: TrainConfig, tiny_dataset: str, tiny_dataset_b: str, tmp_path: Path
) -> None:
    """From the batch-6 checkpoint (half an epoch) to batch 12: the same per-stream counts at every logged
    step and bit-identical EMA and training weights (kills and rank changes: test_resume_mix.py)."""
    from tests.train.checkpoints.test_resume_ranks import assert_same_weights, final_state, seed_save_folder

    run, save = Path(mix_run.save_folder), tmp_path / "save"
    (checkpoint,) = run.glob("ep0-ba6-rank0.pt")
    seed_save_folder(checkpoint, save)
    done = [row for row in metric_rows(run) if row["step"] <= 6]  # what the run had logged by then
    (save / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in done))
    cfg = mix_config(
        save,
        f"{{uri: {tiny_dataset}, name: laion, proportion: 0.75}}",
        f"{{uri: {tiny_dataset_b}, name: coyo, proportion: 0.25}}",
        extra=("max_duration=12ba", "save_interval=6ba", "log.console_interval=3ba"),
    )
    with single_threaded_torch():
        fit(cfg)
    names = ["laion", "coyo"]
    assert counts_by_step(save, names) == counts_by_step(run, names)
    assert_same_weights(final_state(save), final_state(run), atol=0.0)


def test_checkpoint_records_every_stream_and_the_mix(mix_run: TrainConfig) -> None:
    from train.data.lease import DatasetLease

    state = read_checkpoint(Path(mix_run.save_folder) / LATEST_NAME)["state"]
    dataset = state["callbacks"]["RunRecord"]["dataset"]
    assert dataset["fingerprint"].startswith("mix-")
    assert [(s["name"], s["version"], s["weight"]) for s in dataset["streams"]] == [
        ("laion", "v1", ["proportion", 0.75]),
        ("coyo", "v1", ["proportion", 0.25]),
    ]
    assert state["callbacks"]["StreamSampleCounts"] == {"names": ["laion", "coyo"], "totals": [72, 24]}
    leases = [c for c in mix_run.trainer.state.callbacks if isinstance(c, DatasetLease)]  # type: ignore[attr-defined]
    assert sorted(lease.root for lease in leases) == sorted(s.uri for s in mix_run.data.streams)
    assert all(lease.writes >= 1 and lease.next_write is None for lease in leases)  # held, then released
    resolved = (Path(mix_run.save_folder) / "train_config.yaml").read_text()
    assert "version: v1" in resolved and "name: coyo" in resolved


def copy_run(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


def test_resuming_on_another_mix_is_refused_unless_allowed(
    mix_run: TrainConfig, tiny_dataset: str, tiny_dataset_b: str, tmp_path: Path, caplog: Any
) -> None:
    changed = (
        f"{{uri: {tiny_dataset}, name: laion, proportion: 0.5}}",
        f"{{uri: {tiny_dataset_b}, name: coyo, proportion: 0.5}}",
    )
    save = copy_run(Path(mix_run.save_folder), tmp_path / "save")
    cfg = mix_config(save, *changed, extra=("max_duration=14ba",))
    with (
        pytest.raises(
            DatasetChangedError, match=r"refusing to resume: .*laion=.*proportion 0.75.*Set data.streams"
        ),
        single_threaded_torch(),
    ):
        fit(cfg)
    # Its own cache folders: the refused run's StreamingDataset may still hold the first ones in this process.
    cache = f"data.cache_dir={tmp_path / 'cache-allowed'}"
    allowed = mix_config(save, *changed, extra=("max_duration=14ba", cache), allow_dataset_change="true")
    with caplog.at_level(logging.WARNING), single_threaded_torch():
        fit(allowed)
    assert "data position remapped onto the new data" in caplog.text
    assert "stopped 96 samples into epoch 0" in caplog.text  # saved at the end of the epoch's last batch
    counts = counts_by_step(save, ["laion", "coyo"])
    assert counts[14][0] + counts[14][1] == 14 * 8


def test_phase_handoff_to_a_high_resolution_mix_with_load_weights_only(tiny_run: Any, tmp_path: Path) -> None:
    """Phase 1: the one-dataset 64 px tiny run. Phase 2: a 128 px mix, weights only, fresh optimizer."""
    hi_a, hi_b = tmp_path / "hi-a", tmp_path / "hi-b"
    write_fake_dataset(hi_a, resolution=128, n=16)
    write_fake_dataset(hi_b, resolution=128, n=16, seed=3, salt="hb")
    cfg = mix_config(
        tmp_path / "phase2",
        f"{{uri: {hi_a}, repeat: 1.0}}",
        f"{{uri: {hi_b}, choose: 8}}",
        extra=("max_duration=3ba", f"load_path={tiny_run.save}", "load_weights_only=true"),
        resolution=128,
    )
    with single_threaded_torch():
        trainer = fit(cfg)
    assert int(trainer.state.timestamp.batch) == 3  # started at 0: weights only, not phase 1's position
    # One epoch of the phase-2 mix: all 16 of hi-a (repeat 1.0) and 8 chosen from hi-b.
    assert counts_by_step(Path(cfg.save_folder), ["hi-a", "hi-b"])[3] == [16, 8]


def test_dry_run_plan_counts_epoch_samples_and_storage_per_stream(
    tiny_dataset: str, tiny_dataset_b: str
) -> None:
    from train.launch import plan_train

    overrides = [
        "save_folder=/tmp/plan",
        *stream_overrides(
            f"{{uri: {tiny_dataset}, name: a, choose: 20}}", f"{{uri: {tiny_dataset_b}, name: b, repeat: 2}}"
        ),
    ]
    lines = plan_train("tiny", overrides).cluster
    text = "\n".join(lines)
    assert "data: 2 stream(s) at 64 px, epoch 84 samples (batching random)" in text
    assert "data: 64 samples" not in text
    assert "20 per epoch (23.8%, choose 20)" in text and "64 per epoch (76.2%, repeat 2.0)" in text
    assert text.count("MB stored") == 2


def test_a_one_dataset_checkpoint_is_not_resumed_on_a_mix(
    tiny_run: Any, tiny_dataset: str, tiny_dataset_b: str, tmp_path: Path
) -> None:
    save = copy_run(tiny_run.save, tmp_path / "save")
    cfg = mix_config(
        save,
        f"{{uri: {tiny_dataset}, name: a, proportion: 0.5}}",
        f"{{uri: {tiny_dataset_b}, name: b, proportion: 0.5}}",
        extra=("max_duration=14ba",),
    )
    with (
        pytest.raises(DatasetChangedError, match=r"trained on the one dataset .* but this run reads the mix"),
        single_threaded_torch(),
    ):
        fit(cfg)


@pytest.mark.s3
def test_a_mix_of_an_s3_and_a_local_dataset(s3_prefix: str, tiny_dataset_b: str, tmp_path: Path) -> None:
    """One stream on S3 (SeaweedFS), one local: each pinned in its own cache folder, counted, recorded."""
    data = f"{s3_prefix}/laion"
    write_fake_dataset(data, n=16)
    cfg = mix_config(
        tmp_path / "save",
        f"{{uri: {data}, choose: 8}}",
        f"{{uri: {tiny_dataset_b}, name: coyo, repeat: 0.25}}",
        extra=("max_duration=2ba", "save_interval=2ba"),
    )
    with single_threaded_torch():
        fit(cfg)
    assert counts_by_step(Path(cfg.save_folder), ["laion", "coyo"])[2] == [8, 8]
    record = read_checkpoint(Path(cfg.save_folder) / LATEST_NAME)["state"]["callbacks"]["RunRecord"]
    assert [s["uri"] for s in record["dataset"]["streams"]] == [data, tiny_dataset_b]
