"""Sharded checkpoints (issue 11 item 4, issue 15 item 4, issue 14 item 1's trust model).

One spawn of 2 gloo CPU ranks with PyTorch's FSDP (Composer's own FSDP wrapper needs CUDA) saves a
tiny U-Net with AdamW state and the sharded EMA through Composer's own `save_checkpoint`, in Composer's
sharded layout, then resumes it through Composer's own `load_checkpoint` on 2 ranks, on 1 rank, and (as
one rank would have written it) from 1 onto 2 ranks: DCP reshards, and weights, EMA and AdamW moments come
back identical. The main process then exports it, converts
it both ways for a run writing the other format, and prunes sharded folders. Hostile `.metadata` and
`.distcp` files are refused before they run anything.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from composer.core import Event
from composer.loggers import Logger
from composer.utils import checkpoint as composer_checkpoint
from torch import nn
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel

from shared import storage
from shared.config import ConfigError, config_to_dict
from shared.models import build_unet
from shared.presets import get_preset
from tests.train.conftest import tiny_config
from train.bench.ckpt import (
    bytes_written_by_rank,
    composer_state,
    fsdp_wrap,
    init_gloo,
    measure_checkpoint_save,
    save_with_composer,
)
from train.checkpoints.files import (
    LATEST_NAME,
    SYMLINK_SUFFIX,
    UnsafeCheckpointError,
    fetched_checkpoint,
    find_latest_checkpoint,
    load_weights_only,
    resolve_checkpoint,
)
from train.checkpoints.record import RunRecord
from train.checkpoints.retention import CheckpointRetention
from train.checkpoints.sharded import (
    composer_reads_sharded_safely,
    consolidate_sharded_checkpoint,
    load_path_in_format,
    read_full_checkpoint,
    read_metadata_safely,
)
from train.config import ModelConfig, TrainConfig
from train.ema.algorithm import build_ema
from train.ema.names import EMAStoreMismatchError
from train.ema.shards import local_layout
from train.ema.store import NamedEMAStore, cloned_weights
from train.loop.comm_counter import count_collectives
from train.loop.cpu_fsdp import no_cpu_offload
from train.loop.trainer import parallelism_config

RANKS = 2
PRESET = "tiny"
RESOLUTION = 64


# ------------------------------------------------------------------------------------- the 2-rank run
def run_record(unet: nn.Module) -> dict[str, Any]:
    """What train.loop.callbacks.run_record stores, for the tiny preset (export rebuilds the encoders from
    it)."""
    return {
        "run_name": "ckpt",
        "dataset": {"uri": "x", "version": "v1", "resolution": RESOLUTION, "fingerprint": "f"},
        "preset": PRESET,
        "unet_config": json.loads(json.dumps(dict(unet.config), default=list)),
        "model": config_to_dict(ModelConfig(preset=PRESET)),
        "scale_factor": float(get_preset(PRESET).scale_factor),
        "encoders": {},
        "encoder_config": {"pretrained": None, "text_backend": "transformers"},
    }


def train_step(holder: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    preset = get_preset(PRESET)
    torch.manual_seed(seed)
    latents = torch.randn(2, *preset.latent_shape(RESOLUTION))
    text = torch.randn(2, *preset.text_shape())
    out = holder.unet(latents, torch.tensor([10, 500]), encoder_hidden_states=text).sample
    out.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def new_holder(offset: float) -> tuple[nn.Module, nn.Module]:
    """(holder with `.unet`, the unwrapped U-Net), weights shifted by `offset` so a load must change them."""
    unet = build_unet(get_preset(PRESET))
    with torch.no_grad():
        for param in unet.parameters():
            param.add_(offset)
    holder = nn.Module()
    holder.unet = unet
    return holder, unet


def snapshot(holder: nn.Module, optimizer: torch.optim.Optimizer, ema: Any) -> dict[str, torch.Tensor]:
    """Full weights, full EMA and full AdamW moments (collective), flattened to name -> tensor."""
    with FullyShardedDataParallel.summon_full_params(holder.unet, writeback=False):
        out = {f"model/{k}": v for k, v in cloned_weights(holder)[0].items()}
    for name, tensor in ema.ema_model.checkpoint_state()["named_parameters_dict"].items():  # gathered
        out[f"ema/{name}"] = tensor
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    for name, moments in get_optimizer_state_dict(holder, optimizer, options=options)["state"].items():
        for key, tensor in moments.items():
            out[f"optim/{name}/{key}"] = torch.as_tensor(tensor).clone()
    return out


def resume(path: str, record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A fresh model (other weights), optimizer and EMA on this process group, resumed from `path` by
    Composer's own load_checkpoint as the trainer runs it (safe sharded reader), EMA placed at FIT_START."""
    holder, unet = new_holder(offset=1.0)
    ema = build_ema(0.5, "0ba", "1ba", handoff=False)
    ema.ema_model = NamedEMAStore(holder)  # what HandoffEMA makes at INIT, before the model is wrapped
    holder.unet = fsdp_wrap(unet)
    optimizer = torch.optim.AdamW(holder.parameters(), lr=1e-3)
    state = composer_state(holder, optimizer, "sharded", [ema], [RunRecord(record)])
    with composer_reads_sharded_safely(), no_cpu_offload():
        composer_checkpoint.load_checkpoint(path, state, Logger(state))
    ema.apply(Event.FIT_START, state, Logger(state))
    return snapshot(holder, optimizer, ema)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def optimizer_state_round_trip(channels_last: bool) -> float:
    """AdamW moments of an FSDP conv model read out as a full state dict and loaded into the same model
    (torch's own `get/set_optimizer_state_dict`, as Composer resumes): max abs change (collective)."""
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Conv2d(8, 6, 3))
    if channels_last:
        conv.to(memory_format=torch.channels_last)
    holder = nn.Module()
    holder.unet = fsdp_wrap(conv)
    optimizer = torch.optim.AdamW(holder.parameters(), lr=1e-2)
    holder.unet(torch.randn(2, 4, 9, 9)).square().mean().backward()
    optimizer.step()
    before = [t.clone() for state in optimizer.state.values() for t in state.values() if t.dim()]
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    saved = get_optimizer_state_dict(holder, optimizer, options=options)
    set_optimizer_state_dict(holder, optimizer, saved, options=options)
    after = [t for state in optimizer.state.values() for t in state.values() if t.dim()]
    return max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(after, before, strict=True))


def sharded_ema_refuses_nhwc_weights() -> bool:
    """The sharded EMA labels shards as row-major flat ranges: NHWC weights are refused, not scrambled."""
    wrapped = fsdp_wrap(nn.Sequential(nn.Conv2d(4, 8, 3)).to(memory_format=torch.channels_last))
    try:
        local_layout(wrapped)
    except EMAStoreMismatchError as err:
        return "non-row-major" in str(err)
    return False


def rank_main(rank: int, work: str) -> None:
    init_gloo(rank, RANKS, work)
    moved = {fmt: optimizer_state_round_trip(fmt == "nhwc") for fmt in ("nchw", "nhwc")}
    moved["ema_refuses_nhwc"] = float(sharded_ema_refuses_nhwc_weights())
    (Path(work) / f"optim-round-trip-{rank}.json").write_text(json.dumps(moved))
    holder, unet = new_holder(offset=0.0)
    record = run_record(unet)
    holder.unet = fsdp_wrap(unet)
    optimizer = torch.optim.AdamW(holder.parameters(), lr=1e-2)
    ema = build_ema(0.5, "0ba", "1ba", handoff=False)
    train_step(holder, optimizer, seed=1)
    ema.ema_model = ema.new_store(holder)  # sharded like the parameters
    ema.ema_started = True
    train_step(holder, optimizer, seed=2)
    ema.ema_model.lerp(holder, 0.5)
    state = composer_state(holder, optimizer, "sharded", [ema], [RunRecord(record)])
    with count_collectives() as with_ema:
        path = save_with_composer(state, Path(work) / "save")
    without = composer_state(holder, optimizer, "sharded", [], [RunRecord(record)])
    with count_collectives() as model_only:  # the same save without the EMA: what FSDP's state dict moves
        save_with_composer(without, Path(work) / "save-no-ema")
    expected = snapshot(holder, optimizer, ema)
    (Path(work) / f"save-bytes-{rank}.json").write_text(json.dumps([with_ema.bytes, model_only.bytes]))
    if rank == 0:
        torch.save(expected, Path(work) / "expected.pt")
        (Path(work) / "path.txt").write_text(str(path))
    assert_same(resume(str(path), record), expected)  # on 2 ranks
    one_rank = Path(work) / "written-by-one-rank"
    if rank == 0:  # the same checkpoint as one rank writes it: one shard file holding whole tensors
        writer = dcp.FileSystemWriter(str(one_rank))
        dcp.save(consolidate_sharded_checkpoint(path), storage_writer=writer, no_dist=True)
    dist.barrier()
    assert_same(resume(str(one_rank), record), expected)  # 1 -> 2 ranks
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:  # ... and on 1 rank: DCP reads the 2 ranks' shards into one
        init_gloo(0, 1, work, tag="-solo")
        assert_same(resume(str(path), record), expected)
        (Path(work) / "resumed-on-1.ok").write_text("ok")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    work = tmp_path_factory.mktemp("sharded")
    mp.spawn(rank_main, args=(str(work),), nprocs=RANKS, join=True)
    path = Path((work / "path.txt").read_text())
    expected = torch.load(work / "expected.pt", weights_only=True)
    return SimpleNamespace(work=work, path=path, save=path.parent, expected=expected)


def ema_of(expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("ema/unet."): v for k, v in expected.items() if k.startswith("ema/unet.")}


@pytest.mark.dist
@pytest.mark.slow
def test_sharded_checkpoint_is_composer_layout_written_by_every_rank_and_reshards_on_resume(
    sharded_run: SimpleNamespace,
) -> None:
    path = sharded_run.path
    assert path.name == "ep0-ba0"  # Composer's sharded_ckpt_prefix_dir
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    sizes = bytes_written_by_rank(path, RANKS)
    assert min(sizes) > 0.2 * sum(sizes), sizes  # both ranks wrote a real part of it
    assert (sharded_run.work / "resumed-on-1.ok").exists()  # rank_main asserted the 2- and 1-rank resumes
    ema = ema_of(sharded_run.expected)
    weights = {k.removeprefix("model/unet."): v for k, v in sharded_run.expected.items() if "model/" in k}
    assert any(not torch.equal(ema[k], weights[k]) for k in ema)  # the EMA is not the training weights


@pytest.mark.dist
@pytest.mark.slow
def test_torch_misloads_adamw_state_of_channels_last_weights_under_fsdp(sharded_run: SimpleNamespace) -> None:
    """Why the U-Net keeps NCHW weights under FSDP (train/model/assemble.py): torch 2.7 loads a channels_last
    FSDP parameter's AdamW moments permuted (`_optim_utils.py` slices `value.flatten()` while the flat
    parameter is in memory order), even saved and loaded in the same layout. If this starts failing, torch
    fixed it and NHWC weights under FSDP can be reconsidered (docs/gpu-path.md)."""
    for rank in range(RANKS):
        moved = json.loads((sharded_run.work / f"optim-round-trip-{rank}.json").read_text())
        assert moved["nchw"] == 0.0, moved
        assert moved["ema_refuses_nhwc"] == 1.0, moved
    assert max(json.loads((sharded_run.work / f"optim-round-trip-{r}.json").read_text())["nhwc"]
               for r in range(RANKS)) > 1e-4  # fmt: skip


def ema_bytes_by_shard_file(path: Path) -> dict[str, int]:
    """Bytes of EMA parameter data in each `.distcp` file, from the checkpoint's own index."""
    written: dict[str, int] = {}
    for index, info in read_metadata_safely(path).storage_data.items():
        if ".ema_model.named_parameters_dict." in index.fqn:
            written[info.relative_path] = written.get(info.relative_path, 0) + info.length
    return written


@pytest.mark.dist
@pytest.mark.slow
def test_sharded_save_writes_the_ema_as_shards_from_every_rank_without_gathering_it(
    sharded_run: SimpleNamespace,
) -> None:
    ema_bytes = sum(t.numel() * t.element_size() for t in ema_of(sharded_run.expected).values())
    written = ema_bytes_by_shard_file(sharded_run.path)
    assert sorted(written) == ["__0_0.distcp", "__1_0.distcp"], written  # both ranks wrote EMA shards
    assert sum(written.values()) >= ema_bytes  # the whole EMA is in the checkpoint (plus pickle framing)
    for part in written.values():  # each rank its own half: no rank wrote the whole EMA
        assert 0.3 * ema_bytes < part < 0.7 * ema_bytes, (written, ema_bytes)
    for rank in range(RANKS):  # the EMA adds no gather to the save (a gather would move >= half of it)
        with_ema, model_only = json.loads((sharded_run.work / f"save-bytes-{rank}.json").read_text())
        assert with_ema - model_only < 0.1 * ema_bytes, (with_ema, model_only, ema_bytes)


@pytest.mark.dist
@pytest.mark.slow
def test_sharded_checkpoint_exports_and_converts_for_a_run_writing_the_other_format(
    sharded_run: SimpleNamespace, tmp_path: Path
) -> None:
    from diffusers import UNet2DConditionModel

    from train.export.pipeline import export_pipeline

    save = tmp_path / "save"
    shutil.copytree(sharded_run.save, save)
    os.symlink("ep0-ba0", save / LATEST_NAME)
    assert find_latest_checkpoint(str(save)) == str(save / "ep0-ba0")
    assert resolve_checkpoint(str(save / "ep0-ba0")) == str(save / "ep0-ba0")

    result = export_pipeline(str(save), str(tmp_path / "pipe"))
    assert result.weights == "ema"
    exported = UNet2DConditionModel.from_pretrained(tmp_path / "pipe", subfolder="unet").state_dict()
    for name, tensor in ema_of(sharded_run.expected).items():
        assert torch.equal(exported[name], tensor), name

    consolidated = consolidate_sharded_checkpoint(save / "ep0-ba0")
    with load_path_in_format(str(save / "ep0-ba0"), "full") as as_full:
        assert as_full is not None and as_full.endswith(".pt")
        full = load_weights_only(as_full)  # a full run loads this through the weights-only unpickler
        for name, tensor in consolidated["state"]["model"].items():
            assert torch.equal(full["state"]["model"][name], tensor), name
        with load_path_in_format(as_full, "sharded") as as_sharded:
            assert as_sharded is not None and Path(as_sharded, ".metadata").is_file()
            back = consolidate_sharded_checkpoint(as_sharded)
            for name, tensor in consolidated["state"]["model"].items():
                assert torch.equal(back["state"]["model"][name], tensor), name
        assert as_sharded is not None and not Path(as_sharded).exists()  # scratch removed
    with load_path_in_format(str(save / "ep0-ba0"), "sharded") as same:
        assert same == str(save / "ep0-ba0")  # same format: handed to Composer as is


@pytest.mark.dist
@pytest.mark.slow
def test_retention_deletes_whole_sharded_checkpoint_folders(
    sharded_run: SimpleNamespace, tmp_path: Path
) -> None:
    save = tmp_path / "save"
    for batch in (2, 4, 6):
        shutil.copytree(sharded_run.path, save / f"ep0-ba{batch}")
    os.symlink("ep0-ba4", save / LATEST_NAME)
    doomed = CheckpointRetention(str(save), keep=1, interval="2ba").prune()
    assert doomed == [str(save / "ep0-ba2")]
    assert sorted(p.name for p in save.iterdir()) == ["ep0-ba4", "ep0-ba6", LATEST_NAME]  # newer: kept


@pytest.mark.dist
@pytest.mark.slow
def test_measure_checkpoint_save_reports_bytes_per_rank_full_vs_sharded() -> None:
    result = measure_checkpoint_save(width=128, depth=4, repeats=1)
    assert result["ranks"] == RANKS
    full, sharded = result["full"], result["sharded"]
    assert full["bytes_per_rank"][1] == 0 and full["max_rank_share"] == 1.0  # rank 0 writes it all
    assert min(sharded["bytes_per_rank"]) > 0 and sharded["max_rank_share"] < 0.8
    # weights + EMA + two AdamW moments, 4 bytes each, in either format
    assert full["total_bytes"] >= 4 * 4 * result["params"]
    assert sharded["total_bytes"] >= 4 * 4 * result["params"]
    assert full["seconds_per_save"] > 0 and sharded["seconds_per_save"] > 0


# ------------------------------------------------------------------------- config and trainer wiring
def test_checkpoint_format_auto_is_sharded_under_fsdp_on_several_ranks() -> None:
    cfg = TrainConfig(save_folder="/tmp/unused", fsdp=True, device="gpu")
    assert cfg.resolved_checkpoint_format(8) == "sharded"
    assert cfg.resolved_checkpoint_format(1) == "full"
    assert TrainConfig(save_folder="x").resolved_checkpoint_format(8) == "full"  # DDP: no sharded writer
    forced = TrainConfig(save_folder="x", fsdp=True, device="gpu", checkpoint_format="full")
    assert forced.resolved_checkpoint_format(8) == "full"
    with pytest.raises(ConfigError, match="checkpoint_format=sharded needs fsdp=true"):
        TrainConfig(save_folder="x", checkpoint_format="sharded")
    ctx = SimpleNamespace(cfg=cfg, precision="amp_bf16", batching=SimpleNamespace(world_size=256))
    fsdp = parallelism_config(ctx)["fsdp"]  # type: ignore[arg-type,index]
    assert fsdp["state_dict_type"] == "sharded"
    assert fsdp["save_planner"].dedup_save_to_lowest_rank is False  # replicated values spread over ranks
    solo = SimpleNamespace(cfg=cfg, precision="amp_bf16", batching=SimpleNamespace(world_size=1))
    assert parallelism_config(solo)["fsdp"]["state_dict_type"] == "full"  # type: ignore[arg-type,index]


# ---------------------------------------------------------------------------------- hostile checkpoints
class PlantsMarker:
    """Unpickling this creates `path`: stands in for any code a planted checkpoint would run."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (self.path,))


def small_sharded_checkpoint(folder: Path, extra: Any = None) -> Path:
    state: dict[str, Any] = {"state": {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3}}
    if extra is not None:
        state["state"]["extra"] = extra
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    return folder


def test_a_planted_metadata_pickle_is_refused_before_it_runs(tmp_path: Path) -> None:
    folder = small_sharded_checkpoint(tmp_path / "ep0-ba4")
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(PlantsMarker(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*pathlib\.Path\.touch"):
        read_metadata_safely(folder)
    with pytest.raises(UnsafeCheckpointError):
        consolidate_sharded_checkpoint(folder)
    with composer_reads_sharded_safely(), pytest.raises(UnsafeCheckpointError):
        composer_checkpoint.FileSystemReaderWithValidation(str(folder)).read_metadata()
    assert not marker.exists()
    # control: DCP's own reader (what Composer uses unpatched) runs the planted code
    with pytest.raises(Exception):  # noqa: B017  (whatever the marker object then breaks)
        dcp.FileSystemReader(str(folder)).read_metadata()
    assert marker.exists()


def test_a_planted_value_in_a_shard_file_is_refused_before_it_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    folder = small_sharded_checkpoint(tmp_path / "ep0-ba4", extra=PlantsMarker(marker))
    marker.unlink(missing_ok=True)
    with pytest.raises(UnsafeCheckpointError, match="other than tensors"):
        consolidate_sharded_checkpoint(folder)
    assert not marker.exists()
    # control: DCP's own consolidation (format_utils.dcp_to_torch_save's load) runs it
    reader, planner = dcp.FileSystemReader(str(folder)), _EmptyStateDictLoadPlanner()
    _load_state_dict({}, storage_reader=reader, planner=planner, no_dist=True)
    assert marker.exists()


def test_metadata_naming_a_shard_file_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = small_sharded_checkpoint(tmp_path / "ep0-ba4")
    metadata = read_metadata_safely(folder)
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    buffer = io.BytesIO()
    pickle.dump(metadata, buffer)
    (folder / ".metadata").write_bytes(buffer.getvalue())
    with pytest.raises(UnsafeCheckpointError, match=r"not a \.distcp file directly inside"):
        consolidate_sharded_checkpoint(folder)


def test_latest_may_name_a_complete_sharded_folder_inside_the_save_folder_only(tmp_path: Path) -> None:
    save, elsewhere = tmp_path / "save", tmp_path / "elsewhere"
    save.mkdir()
    small_sharded_checkpoint(save / "ep0-ba4")
    small_sharded_checkpoint(elsewhere / "ep0-ba9")
    os.symlink("ep0-ba4", save / LATEST_NAME)
    assert find_latest_checkpoint(str(save)) == str(save / "ep0-ba4")
    assert resolve_checkpoint(str(save)) == str(save / "ep0-ba4")
    os.remove(save / LATEST_NAME)
    os.symlink(elsewhere / "ep0-ba9", save / LATEST_NAME)
    with pytest.raises(UnsafeCheckpointError, match="directly inside"):
        find_latest_checkpoint(str(save))
    os.remove(save / LATEST_NAME)
    (save / "ep0-ba6").mkdir()  # a folder whose .metadata was never written: incomplete
    os.symlink("ep0-ba6", save / LATEST_NAME)
    with pytest.raises(UnsafeCheckpointError, match="incomplete sharded checkpoint"):
        find_latest_checkpoint(str(save))


@pytest.mark.s3
def test_s3_latest_naming_a_sharded_folder_is_found_fetched_and_pruned_whole(
    s3_prefix: str, tmp_path: Path
) -> None:
    save = f"{s3_prefix}/run"
    _, prefix = storage.split_s3(save)
    for batch in (2, 4):
        local = small_sharded_checkpoint(tmp_path / f"ep0-ba{batch}")
        storage.upload_dir(local, f"{save}/ep0-ba{batch}")
    # what Composer's CheckpointSaver uploads for a sharded save: the folder's key, no trailing slash
    storage.write_bytes(f"{save}/{LATEST_NAME}{SYMLINK_SUFFIX}", f"{prefix}/ep0-ba4".encode())
    assert find_latest_checkpoint(save) == f"{save}/ep0-ba4"
    with fetched_checkpoint(save) as local:
        weights = read_full_checkpoint(local)["state"]["model"]["w"]
    assert torch.equal(weights, torch.arange(6.0).reshape(2, 3))
    storage.write_bytes(f"{save}/ep0-ba6/__0_0.distcp", b"an upload whose .metadata is not there yet")
    storage.write_bytes(f"{save}/{LATEST_NAME}{SYMLINK_SUFFIX}", f"{prefix}/ep0-ba6".encode())
    with pytest.raises(UnsafeCheckpointError, match="incomplete sharded checkpoint"):
        find_latest_checkpoint(save)
    storage.write_bytes(f"{save}/{LATEST_NAME}{SYMLINK_SUFFIX}", f"{prefix}/ep0-ba4".encode())
    assert CheckpointRetention(save, keep=1, interval="2ba").prune() == [f"{save}/ep0-ba2"]
    left = {storage.relpath(info.uri, save).split("/")[0] for info in storage.list_files(save)}
    assert left == {"ep0-ba4", "ep0-ba6", f"{LATEST_NAME}{SYMLINK_SUFFIX}"}


# ------------------------------------------------------------------- the real trainer, one CPU rank
def sharded_copy_of_run(tiny_run: Any, save: Path) -> dict[str, Any]:
    """The tiny run's latest checkpoint rewritten in the sharded layout into a new save folder (what an
    FSDP run on several GPUs leaves there); returns the checkpoint's full state."""
    latest = Path(os.path.realpath(tiny_run.save / LATEST_NAME))
    save.mkdir()
    name = latest.name.removesuffix("-rank0.pt")  # ep1-ba12, Composer's sharded folder name
    with load_path_in_format(str(latest), "sharded") as folder:
        assert folder is not None
        shutil.copytree(folder, save / name)
    os.symlink(name, save / LATEST_NAME)
    return load_weights_only(latest)["state"]


@pytest.mark.slow
def test_a_one_rank_run_resumes_and_hands_off_from_a_sharded_checkpoint(
    tiny_run: Any, tmp_path: Path
) -> None:
    from train.ema.algorithm import select_unet_weights
    from train.loop.trainer import build_trainer

    saved = sharded_copy_of_run(tiny_run, tmp_path / "save")
    data, cache = tiny_run.cfg.data.uri, tmp_path / "cache"
    resumed = build_trainer(
        tiny_config(data, tmp_path / "save", cache, "max_duration=13ba", "samples.enabled=false")
    )
    try:
        assert int(resumed.state.timestamp.batch) == 12  # autoresume found the sharded folder
        model = {k: v for k, v in resumed.state.model.state_dict().items() if k.startswith("unet.")}
        for name, tensor in saved["model"].items():
            assert torch.equal(model[name], tensor), name
    finally:
        resumed.close()
    handoff = build_trainer(
        tiny_config(
            # its own cache: the first trainer's StreamingDataset still holds its shared memory
            data, tmp_path / "phase2", tmp_path / "cache2", f"load_path={tmp_path / 'save'}",
            "load_weights_only=true",
            "max_duration=2ba", "samples.enabled=false",
        )
    )  # fmt: skip
    try:
        assert int(handoff.state.timestamp.batch) == 0
        ema, _ = select_unet_weights(saved, "ema")
        for name, tensor in handoff.state.model.unet.state_dict().items():
            assert torch.equal(tensor, ema[name]), name
    finally:
        handoff.close()
