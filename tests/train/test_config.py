"""Train config: every shipped YAML parses, overrides apply, bad combinations fail with the fix named."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.batching import BatchingError, derive_batching
from shared.config import JOBS_DIR, ConfigError, load_config
from train.config import TrainConfig

TRAIN_JOBS = sorted((JOBS_DIR / "train").glob("*.yaml"))


@pytest.mark.parametrize("path", TRAIN_JOBS, ids=[p.stem for p in TRAIN_JOBS])
def test_every_train_yaml_parses(path: Path) -> None:
    cfg = load_config(TrainConfig, path)
    assert cfg.save_folder and cfg.resolved_run_name()


def test_the_three_required_jobs_exist() -> None:
    assert {"tiny", "sd2-base-256", "sd2-base-512"} <= {p.stem for p in TRAIN_JOBS}


def test_sd2_recipe_numbers() -> None:
    phase1 = load_config(TrainConfig, "sd2-base-256", kind="train")
    phase2 = load_config(TrainConfig, "sd2-base-512", kind="train")
    for cfg in (phase1, phase2):
        assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.optimizer.warmup) == (1e-4, 0.01, "10000ba")
        assert (cfg.global_batch_size, cfg.ema.smoothing, cfg.model.caption_dropout) == (2048, 0.9999, 0.1)
        assert cfg.fsdp_sharding_strategy == "SHARD_GRAD_OP" and cfg.precision == "auto"
        # FSDP on a cluster; one GPU has nothing to shard and trains unwrapped (fsdp: null)
        assert cfg.fsdp is None and cfg.for_world(256).fsdp is True and cfg.for_world(1).fsdp is False
    assert (phase1.data.resolution, phase1.max_duration) == (256, "1126400000sp")
    assert (phase2.data.resolution, phase2.max_duration) == (512, "1740800000sp")
    assert phase2.load_weights_only and phase2.load_path
    for cfg in (phase1, phase2):  # 8 per rank on 256 GPUs in one microbatch: FSDP gathers once per step
        assert derive_batching(cfg.global_batch_size, 256, cfg.device_microbatch_size).grad_accum == 1
        assert cfg.fsdp_reduce_dtype == "fp32"


def test_required_overrides_apply() -> None:
    cfg = load_config(
        TrainConfig,
        "tiny",
        ["data.uri=s3://b/ds", "save_folder=s3://b/run", "max_duration=10000sp"],
        kind="train",
    )
    assert (cfg.data.uri, cfg.save_folder, cfg.max_duration) == ("s3://b/ds", "s3://b/run", "10000sp")
    assert cfg.save_is_remote()


def test_run_name_is_stable_and_follows_save_folder() -> None:
    a = load_config(TrainConfig, "tiny", ["save_folder=/x/run"], kind="train").resolved_run_name()
    b = load_config(TrainConfig, "tiny", ["save_folder=/x/run/"], kind="train").resolved_run_name()
    c = load_config(TrainConfig, "tiny", ["save_folder=/x/other"], kind="train").resolved_run_name()
    assert a == b != c


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("max_duration=20 batches", "Composer time string"),
        ("save_interval=100sp", "units"),
        ("model.prediction_type=epsilon", "v_prediction"),  # tiny.yaml has zero_terminal_snr on
        ("model.caption_dropout=1.5", "caption_dropout"),
        ("ema.smoothing=1.0", "ema.smoothing"),
        ("load_weights_only=true", "load_path"),
        ("data.resolution=60", "multiple"),
        ("save_folder=", "save_folder"),
        ("optimizer.nesterov=true", "unknown key"),
        ("save_num_remote_checkpoints_to_keep=0", "save_num_remote_checkpoints_to_keep"),
        ("data.cache_limit=banana", "data.cache_limit=banana is not a size"),
        ("data.cache_limit=0gb", "above zero"),  # Streaming reads 0 as no limit at all
        ("data.cache_limit=1.5b", "kb, mb, gb"),  # Streaming takes whole bytes only
    ],
)
def test_bad_configs_name_the_fix(override: str, message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        load_config(TrainConfig, "tiny", [override], kind="train")


@pytest.mark.parametrize("size", ["500gb", "500 GB", "1.5tb", "0.5gb", "1000000", "1000000b", "64mb"])
def test_cache_limit_takes_every_size_streaming_reads(size: str) -> None:
    from streaming.base.util import bytes_to_int

    cfg = load_config(TrainConfig, "tiny", [f"data.cache_limit={size}"], kind="train")
    assert cfg.data.cache_limit is not None and bytes_to_int(cfg.data.cache_limit) > 0


def test_cpu_rejects_amp_but_runs_fsdp_and_channels_last_when_asked() -> None:
    with pytest.raises(ConfigError, match="fp32"):
        load_config(TrainConfig, "tiny", ["device=cpu", "precision=amp_bf16"], kind="train")
    # The sharded path on CPU ranks over gloo (issue 22 item 1; tests/train/checkpoints/test_gpu_path.py).
    cfg = load_config(TrainConfig, "tiny", ["device=cpu", "fsdp=true", "channels_last=true"], kind="train")
    assert cfg.fsdp and cfg.channels_last
    assert load_config(TrainConfig, "tiny", [], kind="train").channels_last is None  # auto: GPU only


def test_zero_terminal_snr_with_v_prediction_is_fine() -> None:
    cfg = load_config(
        TrainConfig,
        "tiny",
        ["model.zero_terminal_snr=true", "model.prediction_type=v_prediction"],
        kind="train",
    )
    assert cfg.model.zero_terminal_snr


def test_ema_update_interval_keeps_half_life() -> None:
    cfg = load_config(TrainConfig, "tiny", ["ema.smoothing=0.9999", "ema.update_interval=10ba"], kind="train")
    assert cfg.ema_smoothing_per_update() == pytest.approx(0.9999**10)


@pytest.mark.parametrize(
    ("global_batch", "world", "micro", "per_rank", "accum"),
    [(2048, 256, 4, 8, 2), (2048, 8, 32, 256, 8), (8, 1, 4, 8, 2), (4, 4, 1, 1, 1)],
)
def test_derive_batching(global_batch: int, world: int, micro: int, per_rank: int, accum: int) -> None:
    got = derive_batching(global_batch, world, micro)
    assert (got.per_rank_batch, got.grad_accum, got.microbatch) == (per_rank, accum, micro)


@pytest.mark.parametrize(("global_batch", "world", "micro"), [(2048, 3, 4), (2048, 256, 3), (0, 1, 1)])
def test_derive_batching_refuses_uneven_splits(global_batch: int, world: int, micro: int) -> None:
    with pytest.raises(BatchingError):
        derive_batching(global_batch, world, micro)


def test_cpu_machine_resolves_auto_to_cpu_fp32() -> None:
    import torch

    from train.loop.prepare import resolve_device, resolve_precision

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only resolution")
    cfg = load_config(TrainConfig, "sd2-base-256", kind="train")  # fsdp: null, precision: auto
    # a GPU job on a host whose GPUs are not seen
    with pytest.raises(ConfigError, match=r"fsdp=null needs GPUs .* pass fsdp=false"):
        resolve_device(cfg)
    assert resolve_device(load_config(TrainConfig, "sd2-base-256", ["device=cpu"], kind="train")) == "cpu"
    cpu = load_config(TrainConfig, "tiny", ["precision=auto"], kind="train")
    assert resolve_precision(cpu, resolve_device(cpu)) == "fp32"


def test_device_auto_on_a_node_without_gpus_in_a_job_of_several_nodes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One node of a GPU job whose GPUs are not seen would join with gloo where its peers use NCCL; a CPU
    job on several nodes says device=cpu. One node of CPU ranks keeps device=auto."""
    import torch

    from train.loop.prepare import resolve_device

    if torch.cuda.is_available():
        pytest.skip("checks a node without GPUs")
    auto = load_config(TrainConfig, "tiny", ["fsdp=false", "device=auto"], kind="train")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_device(auto) == "cpu"  # one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(
        ConfigError, match=r"device=auto but this node \(.+\) sees no GPU, in a job of 2 nodes"
    ):
        resolve_device(auto)
    assert (
        resolve_device(load_config(TrainConfig, "tiny", ["fsdp=false", "device=cpu"], kind="train")) == "cpu"
    )


def test_fsdp_null_shards_on_a_cluster_and_leaves_one_rank_unwrapped(tmp_path: Path) -> None:
    """fsdp: null (the SD2 recipes): FSDP when the run has more than one rank; one rank has nothing to shard,
    so it trains unwrapped (its U-Net one compiled graph). The dry-run plan decides it as the job does."""
    from shared.launch.plan import LaunchOptions
    from train.launch import plan_train

    save = f"save_folder={tmp_path}"
    cfg = load_config(TrainConfig, "sd2-base-256", [save], kind="train")
    assert (cfg.for_world(1).fsdp, cfg.for_world(2).fsdp, cfg.for_world(256).fsdp) == (False, True, True)
    assert (cfg.resolved_checkpoint_format(1), cfg.resolved_checkpoint_format(256)) == ("full", "sharded")
    one = "\n".join(plan_train("sd2-base-256", [save], LaunchOptions(1, "local")).cluster)
    many = "\n".join(plan_train("sd2-base-256", [save], LaunchOptions(256, "slurm")).cluster)
    assert "the whole U-Net as one graph" in one and "(SHARD_GRAD_OP" not in one
    assert "one graph per FSDP unit" in many and "(SHARD_GRAD_OP" in many
    # What FSDP cannot do is refused once null means FSDP, naming the fix; on one rank it is allowed.
    graphs = load_config(TrainConfig, "sd2-base-256", [save, "compile_mode=reduce-overhead"], kind="train")
    assert graphs.for_world(1).fsdp is False
    with pytest.raises(ConfigError, match="pass fsdp=false"):
        graphs.for_world(256)
    refused = plan_train("sd2-base-256", [save, "compile_mode=reduce-overhead"], LaunchOptions(256, "slurm"))
    assert any("pass fsdp=false" in why for why in refused.refusals)
    sharded = load_config(TrainConfig, "sd2-base-256", [save, "checkpoint_format=sharded"], kind="train")
    assert sharded.for_world(8).fsdp is True
    with pytest.raises(ConfigError, match="checkpoint_format=sharded needs fsdp=true"):
        sharded.for_world(1)
    explicit = load_config(TrainConfig, "sd2-base-256", [save, "fsdp=true"], kind="train")
    assert explicit.for_world(1) is explicit  # asked for: FSDP (NO_SHARD) on one rank too (the bench's twin)
