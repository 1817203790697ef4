"""The train dry run's memory row (issue 30): device_microbatch_size against the planned GPU type's memory,
from the activations shared/estimate/memory.py keeps, and that table against a fresh measurement."""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path
from typing import Any

import pytest

from shared.config import ConfigError, load_config
from shared.estimate.config import MemoryConfig
from shared.estimate.memory import ACTIVATION_BYTES_PER_IMAGE, MEASURED_RECIPES
from shared.launch.plan import LaunchOptions
from shared.launch.report import summarize
from train.bench.anatomy.memory import measure_recipe
from train.config import TrainConfig
from train.launch import plan_train


def test_table_matches_a_fresh_measurement_of_the_tiny_preset() -> None:
    """The cheap entry re-measured as `python -m train.bench.anatomy.memory` does (the SD2 ones are too big
    for a test): a torch or model change that moves what autograd saves shows here."""
    config, overrides = next(entry for entry in MEASURED_RECIPES if "model.preset=tiny" in entry[1])
    preset, resolution, per_image = measure_recipe(config, overrides)
    assert ACTIVATION_BYTES_PER_IMAGE[(preset, resolution)] == per_image, (
        f"re-measure the table: python -m train.bench.anatomy.memory (got {per_image:_.0f})"
    )


@pytest.mark.parametrize("recipe", ["sd2-base-256", "sd2-base-512"])
def test_the_estimates_memory_section_is_the_train_recipes(recipe: str) -> None:
    cfg, memory = load_config(TrainConfig, recipe, kind="train"), MemoryConfig()
    assert memory.microbatch[str(cfg.data.resolution)] == cfg.device_microbatch_size
    assert memory.global_batch == cfg.global_batch_size and memory.preset == cfg.model.preset
    cluster = cfg.global_batch_size // cfg.device_microbatch_size  # the GPUs the recipe's batch is sized for
    assert memory.strategy == (cfg.fsdp_sharding_strategy if cfg.uses_fsdp(cluster) else "DDP")
    assert (recipe, ()) in MEASURED_RECIPES and (
        cfg.model.preset,
        cfg.data.resolution,
    ) in ACTIVATION_BYTES_PER_IMAGE


def _rows(plan_text: str, key: str) -> list[str]:
    return [line.split(key, 1)[1].strip() for line in plan_text.splitlines() if line.strip().startswith(key)]


def test_dry_run_prints_the_memory_check_for_its_gpu_type(tmp_path: Path) -> None:
    plan = plan_train(
        "sd2-base-256", [f"save_folder={tmp_path}"], LaunchOptions(256, "slurm"), gpu_type="H200"
    )
    out = summarize(plan)
    (memory,) = _rows(out, "memory")
    assert memory.startswith("256 px on H200: 8 per GPU uses 3.7 GB of 141 GB")
    assert "up to 487 fit (256 as a power of two)" in memory
    assert (
        "global_batch_size=65536 with device_microbatch_size=256 (a new recipe: retune the learning rate)"
        in memory
    )
    assert not any("WARNING" in note for note in plan.notes)
    assert out.index("  batch ") < out.index("  memory ")  # next to the batch split


def test_dry_run_warns_when_the_microbatch_does_not_fit(tmp_path: Path) -> None:
    overrides = [f"save_folder={tmp_path}", "device_microbatch_size=64", "fsdp=false"]
    plan = plan_train("sd2-base-512", overrides, LaunchOptions(1, "local"), gpu_type="A100-40GB")
    assert not plan.refusals  # a warning, not a refusal
    (warning,) = [note for note in plan.notes if note.startswith("WARNING")]
    assert warning == (
        "WARNING: device_microbatch_size=64 on A100-40GB (77.5 GB of 40 GB, at most 17 per GPU) does NOT "
        "fit: set device_microbatch_size=16 (accumulation keeps the global batch)"
    )
    assert "does NOT fit" in plan.memory


def test_dry_run_names_switches_the_table_was_not_measured_with(tmp_path: Path) -> None:
    overrides = [f"save_folder={tmp_path}", "model.gradient_checkpointing=true"]
    plan = plan_train("sd2-base-256", overrides, LaunchOptions(8, "slurm"), gpu_type="H100")
    assert plan.memory.endswith("this run has model.gradient_checkpointing=true)")
    unmeasured = plan_train("tiny", [f"save_folder={tmp_path}", "data.resolution=128"], LaunchOptions(1))
    assert unmeasured.memory.startswith("no measured activation bytes for tiny at 128 px on A100-40GB")


@pytest.mark.parametrize(
    ("gpus", "level", "says"),
    [
        (1, "WARNING", "most of it unused: set device_microbatch_size=256 (fewer accumulation steps"),
        (256, "INFO", "most of it unused: up to 512 per GPU fit; this global batch on 4 GPUs"),
    ],
)
def test_a_gpu_run_says_what_its_microbatch_leaves_unused_on_the_gpu_it_found(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, gpus: int, level: str, says: str
) -> None:
    """The dry-run plan's memory line, at the start of a run on the GPU it found (train/loop/prepare.py):
    a warning where a larger microbatch divides the rank's batch (sd2-base-256 on one H200), one info line
    where only a new recipe would use more (its 256 GPUs)."""
    from train.loop.prepare import log_memory_fit

    cfg = load_config(TrainConfig, "sd2-base-256", [f"save_folder={tmp_path}"], kind="train").for_world(gpus)
    with caplog.at_level("INFO", logger="train.loop.prepare"):
        log_memory_fit(cfg, gpus, "NVIDIA H200", 150.0)
    (record,) = caplog.records
    assert record.levelname == level and "256 px on NVIDIA H200: 8 per GPU uses" in record.getMessage()
    assert says in record.getMessage(), record.getMessage()
    caplog.clear()
    unmeasured = load_config(
        TrainConfig, "tiny", [f"save_folder={tmp_path}", "data.resolution=128"], kind="train"
    )
    log_memory_fit(unmeasured, 1, "NVIDIA H200", 150.0)  # no activation bytes measured: nothing said
    assert caplog.records == []


def test_a_null_microbatch_is_the_largest_that_divides_the_ranks_batch_and_fits(tmp_path: Path) -> None:
    """device_microbatch_size=null: decided from the GPU's memory (the job: the GPU it finds; the dry-run
    plan: --gpu-type), the rank's batch where there is no GPU memory or no measurement."""
    from shared.estimate.gpus import GPU_TABLE
    from shared.estimate.memory import microbatch_that_fits

    # SD2-base at 256 px on one 150 GB GPU: 17.3 GB resident, 0.242 GB an image: 455 fit, 256 divides 2048
    assert microbatch_that_fits(150.0, "sd2-base", 256, 2048, 1, "DDP") == 256
    assert microbatch_that_fits(150.0, "sd2-base", 256, 8, 256, "SHARD_GRAD_OP") == 8  # the rank's batch
    assert microbatch_that_fits(40.0, "sd2-base", 512, 2048, 1, "DDP") == 16  # 0.941 GB an image
    assert microbatch_that_fits(150.0, "sd2-base", 768, 2048, 1, "DDP") is None  # not measured
    null = [f"save_folder={tmp_path}", "device_microbatch_size=null"]
    cfg = load_config(TrainConfig, "sd2-base-256", null, kind="train")
    assert cfg.device_microbatch_size is None
    assert cfg.for_world(1).with_microbatch_for(1, 150.0).device_microbatch_size == 256
    assert cfg.for_world(1).with_microbatch_for(1, None).device_microbatch_size == 2048  # CPU: the rank's
    assert cfg.for_world(16).with_microbatch_for(16, 80.0).device_microbatch_size == 128
    plan = plan_train("sd2-base-256", null, LaunchOptions(1, "slurm"), gpu_type="H200")
    expected = microbatch_that_fits(GPU_TABLE["H200"].memory_gb, "sd2-base", 256, 2048, 1, "DDP")
    assert plan.batching is not None and plan.batching.microbatch == expected == 256
    assert "256 per GPU uses" in plan.memory and "most of it unused" not in plan.memory


def test_ranks_that_sized_their_microbatch_differently_are_refused_naming_the_smallest() -> None:
    from train.loop.prepare import check_ranks_agree, rank_spans

    assert rank_spans([8, 0, 1, 2, 5, 7]) == "0-2, 5, 7-8"
    a40, a80 = "NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB"
    check_ranks_agree([{"gpu": a80, "device_microbatch_size": "16"}] * 16)
    mixed = [
        {"gpu": a40 if r < 8 else a80, "device_microbatch_size": "16" if r < 8 else "32"} for r in range(16)
    ]
    with pytest.raises(ConfigError) as err:
        check_ranks_agree(mixed)
    assert str(err.value).startswith(
        f"device_microbatch_size=null sized the microbatch from each rank's GPU and the ranks differ: 16 on "
        f"ranks 0-7 ({a40}); 32 on ranks 8-15 ({a80}). Set device_microbatch_size=16 (the smallest)"
    )


def gather_and_check(rank: int, store: str, agree: bool, errors: Any) -> None:
    """One gloo rank of the real gather the train job makes after joining (train/loop/trainer.py)."""
    import torch.distributed as torch_dist
    from composer.utils import dist

    from train.loop.prepare import check_ranks_agree

    # a spawned rank inherits its pytest worker's environment, where an in-process Composer run may have
    # left WORLD_SIZE=1; Composer checks these against torch.distributed
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", NODE_RANK="0"
    )
    faulthandler.dump_traceback_later(90, exit=True)  # a stuck rank shows where, and ends, inside the timeout
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        microbatch = "16" if agree or rank == 0 else "32"
        check_ranks_agree(
            dist.all_gather_object({"gpu": f"gpu {rank}", "device_microbatch_size": microbatch})
        )
    except ConfigError as err:
        errors.put((rank, str(err)))
    torch_dist.barrier()
    # Both ranks are done with the group: leave without tearing gloo down (destroy_process_group, or the
    # group's destructor at exit, hung one rank now and then on the loaded 2-core CI box).
    os._exit(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("agree", [True, False])
def test_every_rank_refuses_alike_after_one_real_gather(
    tmp_path: Path, agree: bool, killed_temp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank sees every rank's decision, so all refuse with one message (or none does): no rank waits
    in a collective for a rank that already stopped."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("TMPDIR", str(killed_temp))  # the ranks leave by os._exit: their temp folder
    errors = mp.get_context("spawn").SimpleQueue()
    store = str(tmp_path / "pg-store")
    mp.spawn(gather_and_check, args=(store, agree, errors), nprocs=2, join=True)
    said = sorted(errors.get() for _ in range(2)) if not agree else []
    assert errors.empty()
    if not agree:
        assert [rank for rank, _ in said] == [0, 1] and said[0][1] == said[1][1]
        assert "16 on rank 0 (gpu 0); 32 on rank 1 (gpu 1)" in said[0][1]


def test_ranks_started_with_different_configs_are_refused_naming_the_keys() -> None:
    """The same command typed on each machine of a local multi-node launch, one with another override: the
    nodes formed one world and each trained at its own learning rate; both exited 0."""
    from train.loop.prepare import check_ranks_agree

    same = {"optimizer.lr": "0.0001", "data.uri": '"s3://b/laion"'}
    decisions = [{"gpu": "g", "device_microbatch_size": "8", "config": dict(same)} for _ in range(4)]
    check_ranks_agree(decisions)
    for rank in (2, 3):
        decisions[rank]["config"]["optimizer.lr"] = "0.01"
    with pytest.raises(ConfigError) as err:
        check_ranks_agree(decisions)
    assert "different configs (optimizer.lr: 0.0001 on ranks 0-1; 0.01 on ranks 2-3)" in str(err.value)
    assert "start every node with the same config and overrides" in str(err.value)
