"""The sharded EMA as DCP writes it: each rank's own shard of every parameter, no gather (issue 11).

Under FSDP with original parameters a rank's shard of a parameter is a contiguous range of the parameter
flattened (`_ShardParamInfo.intra_param_start_idx .. intra_param_end_idx`), not a rectangular block, and
DCP stores rectangular chunks at offsets in the full tensor. A flat range of a row-major tensor is a
handful of rectangular blocks (a partial row, whole rows, a partial row, recursively: at most
2 * ndim - 1), each contiguous in memory, so it is exposed as a `ShardedTensor` of the parameter's full
shape whose local shards are views into the store. DCP then writes every rank's part in parallel, records
the offsets, and on load reads into those views whatever rank count wrote the checkpoint; a consolidated
read gives the full tensors, the layout a full checkpoint has.

The ShardedTensor is built from this rank's shards alone (`_init_from_local_shards_and_global_metadata`,
no communication): DCP uses only the local shards and the global size, so the rest of the tensor is
described as blocks placed on the next rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.fsdp import FullyShardedDataParallel

from train.ema.names import EMAStoreMismatchError, clean_name

Block = tuple[list[int], list[int]]  # (offsets, sizes) in the full tensor


def flat_range_blocks(shape: list[int], start: int, stop: int) -> list[Block]:
    """The rectangular blocks, in memory order, that the flat range [start, stop) of a row-major tensor
    of `shape` covers."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [([start], [stop - start])]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:  # inside one row: that row's sub-blocks
        inner = flat_range_blocks(shape[1:], start - first * row, stop - first * row)
        return [([first, *offsets], [1, *sizes]) for offsets, sizes in inner]
    blocks: list[Block] = []
    if start % row:  # the partial first row
        blocks += flat_range_blocks(shape, start, (first + 1) * row)
        first += 1
    whole_end = stop // row
    if whole_end > first:  # the whole rows
        blocks.append(([first] + [0] * (len(shape) - 1), [whole_end - first, *shape[1:]]))
    if stop % row:  # the partial last row
        blocks += flat_range_blocks(shape, whole_end * row, stop)
    return blocks


def local_layout(model: torch.nn.Module) -> dict[str, tuple[list[int], int, int]]:
    """clean name -> (full shape, start, stop) of the flat range of that parameter this rank holds, from
    each FSDP unit's flat parameter (`_shapes`, `_shard_param_infos`). FSDP flattens a parameter in memory
    order, so a channels_last (NHWC) weight's range is not a row-major range of its logical shape: such a
    parameter is refused rather than labelled wrong (the model keeps NCHW weights under FSDP)."""
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    layout: dict[str, tuple[list[int], int, int]] = {}
    for module in model.modules():
        handle = module._handle if isinstance(module, FullyShardedDataParallel) else None
        if handle is None:
            continue
        flat = handle.flat_param
        for param, contiguous in zip(flat._params or [], flat._contiguities, strict=True):
            if not contiguous:
                raise EMAStoreMismatchError(
                    f"sharded EMA: FSDP holds {names[id(param)]} in a non-row-major memory order "
                    "(channels_last weights), so its shard is not a row-major range; build the model as "
                    "train/model/assemble.py does (weights NCHW under FSDP, inputs channels_last)"
                )
        for param, shape, info in zip(flat._params or [], flat._shapes, flat._shard_param_infos, strict=True):
            start, end = info.intra_param_start_idx, info.intra_param_end_idx  # end inclusive
            held = info.in_shard and start is not None and end is not None
            layout[names[id(param)]] = (list(shape), start, end + 1) if held else (list(shape), 0, 0)  # type: ignore[operator]
    return layout


def _sharded(local: torch.Tensor, shape: list[int], start: int, stop: int) -> ShardedTensor:
    """The full-shape ShardedTensor whose local shards view `local` (this rank's flat range)."""
    numel = math.prod(shape)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    shards, metadata, at = [], [], 0
    for offsets, sizes in flat_range_blocks(shape, start, stop):
        count = math.prod(sizes)
        shard_md = ShardMetadata(offsets, sizes, f"rank:{rank}/{local.device}")
        shards.append(Shard(local[at : at + count].view(sizes), shard_md))
        metadata.append(shard_md)
        at += count
    for offsets, sizes in flat_range_blocks(shape, 0, start) + flat_range_blocks(shape, stop, numel):
        # held by the other ranks (named as the next one: nothing reads it, DCP uses local shards only)
        metadata.append(ShardMetadata(offsets, sizes, f"rank:{(rank + 1) % world}/{local.device}"))
    properties = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False)
    global_md = ShardedTensorMetadata(metadata, torch.Size(shape), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, global_md)  # type: ignore[arg-type]


def sharded_parameters(
    stored: Mapping[str, torch.Tensor], model: torch.nn.Module
) -> dict[str, ShardedTensor]:
    """The stored shards (name -> this rank's 1-D range) as full-shape ShardedTensors viewing them, so DCP
    writes them in parallel and loads into them in place."""
    layout = local_layout(model)
    out: dict[str, ShardedTensor] = {}
    for name, local in stored.items():
        if name not in layout:
            raise EMAStoreMismatchError(
                f"sharded EMA: {name} is in no FSDP unit of the model; wrap the whole U-Net with FSDP"
            )
        shape, start, stop = layout[name]
        if local.numel() != stop - start:
            raise EMAStoreMismatchError(
                f"sharded EMA: {name} holds {local.numel()} values but this rank's shard has {stop - start}; "
                "the store was built under another sharding"
            )
        out[name] = _sharded(local, shape, start, stop)
    return out
