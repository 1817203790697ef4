"""Checkpoint save cost, full vs sharded, on 2 CPU ranks under PyTorch's FSDP (issue 11: `scale` section).

A full checkpoint gathers every weight, the EMA and the AdamW state onto rank 0 and writes it from there;
a sharded one has each rank write its own part. Composer's FSDP wrapper needs CUDA, so the model here is
wrapped with PyTorch's FSDP on gloo (`device_id=cpu`, SHARD_GRAD_OP, original parameters, as the trainer
configures it), and both formats are written by Composer's own `save_checkpoint` from a Composer `State`
with the trainer's FSDP checkpoint options (`train.checkpoints.sharded.fsdp_checkpoint_options`), the
sharded EMA store and AdamW after one step. `measure_checkpoint_save` returns bytes written per rank and
seconds per save for each format; tests/train/test_sharded_checkpoints.py drives the same helpers to save,
resume on 1 and 2 ranks, and export.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from composer.core import State
from composer.devices import DeviceCPU
from composer.utils import checkpoint as composer_checkpoint
from composer.utils.parallelism import FSDPConfig, ParallelismConfig
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from train.checkpoints.files import CHECKPOINT_FILENAME, SHARDED_METADATA_NAME
from train.checkpoints.sharded import SHARD_SUFFIX, fsdp_checkpoint_options
from train.ema.algorithm import HandoffEMA, build_ema
from train.loop.cpu_fsdp import no_cpu_offload
from train.loop.trainer import composer_names_the_cpu_in_process

CKPT_RANKS = 2
STORE_NAME = "rendezvous"  # a FileStore in the run's own temp folder: no port to pick, nothing shared
RESULT_NAME = "ckpt-measure.json"


def init_gloo(rank: int, world_size: int, store_dir: str | Path, tag: str = "") -> None:
    """Join a gloo group through a FileStore, with the env Composer's `dist` reads for local ranks."""
    for name in ("RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0")
    torch.set_num_threads(1)
    store = Path(store_dir) / f"{STORE_NAME}{tag}"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)


def fsdp_wrap(module: nn.Module) -> FullyShardedDataParallel:
    """PyTorch's FSDP as the trainer configures Composer's (SHARD_GRAD_OP, original parameters), on CPU."""
    return FullyShardedDataParallel(
        module, device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        use_orig_params=True,
    )  # fmt: skip


def composer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, fmt: str, algorithms: list[Any], callbacks: list[Any]
) -> State:
    """A Composer State over an FSDP-wrapped model, checkpointing in `fmt` ("full" or "sharded")."""
    fsdp = FSDPConfig(sharding_strategy="SHARD_GRAD_OP", use_orig_params=True, **fsdp_checkpoint_options(fmt))
    state = State(
        model=model, rank_zero_seed=0, run_name="ckpt", device=DeviceCPU(), optimizers=optimizer,
        algorithms=algorithms, callbacks=callbacks, parallelism_config=ParallelismConfig(fsdp=fsdp),
    )  # fmt: skip
    for algorithm in algorithms:
        if isinstance(algorithm, HandoffEMA):
            algorithm.attach(state)  # what Event.INIT does in a Trainer: the EMA learns the format
    return state


def save_with_composer(state: State, folder: str | Path) -> str | None:
    """Composer's own save (collective): `<folder>/ep0-ba0/` (sharded, every rank), or
    `<folder>/ep0-ba0-rank0.pt` (full; None on the ranks that write nothing)."""
    composer_names_the_cpu_in_process()  # as the train job's saves: no py-cpuinfo subprocess per rank
    with no_cpu_offload():
        saved = composer_checkpoint.save_checkpoint(state, filename=str(Path(folder) / CHECKPOINT_FILENAME))
    if saved is None:
        return None
    return str(Path(saved).parent) if state.fsdp_sharded_state_dict_enabled else str(saved)


def bytes_written_by_rank(path: str | Path, world_size: int) -> list[int]:
    """Bytes each rank wrote: a sharded folder's `__{rank}_0.distcp` (+ rank 0's `.metadata`), or the
    whole full checkpoint on rank 0."""
    path = Path(path)
    if path.is_file():
        return [path.stat().st_size] + [0] * (world_size - 1)
    sizes = [(path / f"__{rank}_0{SHARD_SUFFIX}").stat().st_size for rank in range(world_size)]
    sizes[0] += (path / SHARDED_METADATA_NAME).stat().st_size
    return sizes


def trained_net(width: int, depth: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, HandoffEMA]:
    """An FSDP-wrapped MLP after one AdamW step (so the optimizer holds its state) with a started,
    sharded EMA: a checkpoint with the parts an SD2 checkpoint has (weights, EMA, AdamW moments)."""
    torch.manual_seed(seed)
    layers = [nn.Linear(width, width) for _ in range(depth)]
    model = nn.Module()
    model.unet = fsdp_wrap(nn.Sequential(*layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.unet(torch.randn(4, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    ema = build_ema(0.9, "0ba", "1ba", handoff=False)
    ema.ema_model = ema.new_store(model)
    ema.ema_started = True
    return model, optimizer, ema


def _time_saves(state: State, folder: Path, repeats: int) -> tuple[float, str | None]:
    seconds = []
    path = None
    for attempt in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        path = save_with_composer(state, folder / f"try{attempt}")
        seconds.append(time.perf_counter() - start)  # save_checkpoint ends in a barrier: all ranks done
    return statistics.median(seconds), path


def _measure_rank(rank: int, work: str, width: int, depth: int, repeats: int) -> None:
    init_gloo(rank, CKPT_RANKS, work)
    model, optimizer, ema = trained_net(width, depth)
    result: dict[str, Any] = {"params": depth * (width * width + width)}
    for fmt in ("full", "sharded"):
        state = composer_state(model, optimizer, fmt, [ema], [])
        seconds, path = _time_saves(state, Path(work) / fmt, repeats)
        if rank == 0 and path is not None:
            sizes = bytes_written_by_rank(path, CKPT_RANKS)
            result[fmt] = {"seconds_per_save": round(seconds, 4), "bytes_per_rank": sizes}
    if rank == 0:
        (Path(work) / RESULT_NAME).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def measure_checkpoint_save(width: int = 512, depth: int = 8, repeats: int = 3) -> dict[str, Any]:
    """Bytes written per rank and median seconds per save, full vs sharded, on 2 gloo CPU ranks.

    `params` counts the unsharded parameters (width^2 x depth); the checkpoint holds them 4 times (weights,
    EMA, AdamW's two moments). `max_rank_share` is the largest share of the checkpoint one rank writes:
    1.0 for full (rank 0 writes everything), ~1/ranks when sharded (every rank writes its shards of the
    weights, the EMA and AdamW's moments)."""
    with tempfile.TemporaryDirectory(prefix="sd-bench-ckpt-") as work:
        mp.spawn(_measure_rank, args=(work, width, depth, repeats), nprocs=CKPT_RANKS, join=True)
        result = json.loads((Path(work) / RESULT_NAME).read_text())
    for fmt in ("full", "sharded"):
        sizes = result[fmt]["bytes_per_rank"]
        result[fmt]["total_bytes"] = sum(sizes)
        result[fmt]["max_rank_share"] = round(max(sizes) / sum(sizes), 3)
    result["ranks"] = CKPT_RANKS
    return result
