"""Sharded checkpoints (torch.distributed.checkpoint, "DCP"): read safely, resharded, consolidated.

Layout, as Composer 0.32 writes it with `parallelism_config.fsdp.state_dict_type="sharded"`
(composer/utils/checkpoint.py `get_save_filename`, callbacks/checkpoint_saver.py): every checkpoint is a
folder `<save_folder>/ep{epoch}-ba{batch}/` holding one `__{rank}_0.distcp` per rank (each rank writes its
own shards of the weights and AdamW state, in parallel) and `.metadata`, written by rank 0 after every rank
finished; `latest-rank0.pt` is a symlink to that folder (for s3:// folders `latest-rank0.pt.symlink` names
its key). Values that are not sharded tensors (RNG states, timestamps, callback state) are `torch.save`d
into the `.distcp` file of one rank.

The EMA is written as shards too (`train/ema/shards.py`), but Composer keeps algorithm state as a list of
`(name, state)` tuples, which DCP treats as one opaque value and pickles whole on one rank. The planners
here (`AlgorithmsTraversingSavePlanner` / `...LoadPlanner`, set by `fsdp_checkpoint_options`) turn those
tuples into 2-item lists before DCP flattens the state, so it walks into each algorithm's dict and writes
the EMA shards from every rank (`state.algorithms.<i>.1.ema_model...`). A checkpoint saved before that holds
`state.algorithms` as one value; the load planner then loads it as one, as before.

Resharding: DCP stores every shard with its offsets in the full tensor, so any rank count reads any
checkpoint; a sharded run on N ranks resumes one written on M ranks. A run that does not shard (one rank,
or `checkpoint_format=full`) and `make export` read it consolidated into a full state dict
(`consolidate_sharded_checkpoint`, no process group).

Trust model (issue 14 item 1): DCP's FileSystemReader unpickles `.metadata` with plain `pickle` and loads
every non-tensor value with `torch.load(weights_only=False)`; both run code from a planted file. Here
`.metadata` goes through `MetadataUnpickler`, which builds only DCP's own metadata dataclasses, torch
dtypes / Size / layouts and plain containers, and refuses anything else naming the file; every value in
the `.distcp` files goes through torch's weights-only unpickler with the checkpoint allow-list
(`train/checkpoints/files.py`); the shard files `.metadata` names must be plain names inside the folder.
`composer_reads_sharded_safely` makes Composer's own sharded loads (autoresume, load_path) use all that.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from composer.utils import checkpoint as composer_checkpoint
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from train.checkpoints.files import (
    CHECKPOINT_SUFFIX,
    SCRATCH_PREFIX,
    SHARDED_METADATA_NAME,
    UnsafeCheckpointError,
    _checkpoint_safe_globals,
    composer_loads_weights_only,
    fetched_checkpoint,
    load_weights_only,
)

log = logging.getLogger(__name__)

SHARD_SUFFIX = ".distcp"

# What a torch 2.7 `.metadata` pickles (read off real files with pickletools): DCP's dataclasses, the
# storage info of its FileSystemWriter, torch dtypes / Size / layout, and the checkpoint id (a path).
_METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # layout by name, from torch's own table
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}),
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` building only the types listed above (plus torch.Size and torch's
    dtype, layout and memory-format constants); any other global is refused, naming the file."""

    def __init__(self, stream: Any, source: str):
        super().__init__(stream)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"refusing to read {self.source}: it asks to build {module}.{name}, which a sharded checkpoint's "
            "metadata never holds. Only checkpoints written by `python -m train fit` load; point load_path "
            "(or the save folder's latest) at one of those"
        )


def read_metadata_safely(folder: str | Path) -> dcp_metadata.Metadata:
    """A sharded checkpoint's `.metadata` through MetadataUnpickler, its shard files checked to be plain
    `.distcp` names inside the folder."""
    path = Path(folder) / SHARDED_METADATA_NAME
    try:
        with path.open("rb") as handle:
            metadata = MetadataUnpickler(handle, str(path)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
        raise UnsafeCheckpointError(
            f"cannot read {path} as a sharded checkpoint's metadata ({err}); the checkpoint is truncated "
            "or not one. Point load_path (or the save folder's latest) at a complete checkpoint"
        ) from err
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{path} does not hold a checkpoint's Metadata; it is not a checkpoint")
    _check_shard_names(metadata, path)
    if metadata.storage_meta is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata


def _check_shard_names(metadata: dcp_metadata.Metadata, path: Path) -> None:
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or "/" in name or "\\" in name or not name.endswith(SHARD_SUFFIX):
            raise UnsafeCheckpointError(
                f"refusing to read {path}: it names the shard file {name!r}, which is not a {SHARD_SUFFIX} "
                "file directly inside the checkpoint folder"
            )
        if name.startswith(".") or name != Path(name).name:
            raise UnsafeCheckpointError(f"refusing to read {path}: shard file name {name!r} is not plain")


def load_value_weights_only(value: io.BytesIO, source: str) -> Any:
    """One non-tensor value of a `.distcp` file (DCP `torch.save`s them) through the weights-only
    unpickler with the checkpoint allow-list; anything else is refused naming the checkpoint."""
    try:
        with torch.serialization.safe_globals(_checkpoint_safe_globals()):
            return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"refusing to load {source}: a value in it holds objects other than tensors and plain data "
            f"({err}). Only checkpoints written by `python -m train fit` load"
        ) from err


class WeightsOnlyPlanner:
    """Wraps a DCP load planner so the values it receives as bytes are unpickled weights-only.

    DCP's DefaultLoadPlanner (and every planner derived from it, such as the consolidating one) calls
    `torch.load(value, weights_only=False)` in `load_bytes`; this places the safely loaded value the same
    way. Any other planner gets the bytes only after they loaded weights-only (in memory: no second read)."""

    def __init__(self, planner: LoadPlanner, source: str):
        self.planner = planner
        self.source = source

    def __getattr__(self, name: str) -> Any:
        return getattr(self.planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = load_value_weights_only(value, self.source)
        planner = self.planner
        if not isinstance(planner, DefaultLoadPlanner):
            value.seek(0)
            planner.load_bytes(read_item, value)
        elif planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
        else:
            planner.state_dict[read_item.dest_index.fqn] = loaded


def _source(reader: FileSystemReader) -> str:
    return str(reader.path)


# Refusals of `.metadata` since the last `unwrapped_refusals` began. torch 2.11's DCP load swallows any
# error of read_metadata (it falls back to rank-local metadata, then fails with "metadata is None"), so the
# refusal is kept here to be raised in its place (torch 2.7's passes it through; CI runs both).
_METADATA_REFUSALS: list[UnsafeCheckpointError] = []


def safe_read_metadata(reader: FileSystemReader) -> dcp_metadata.Metadata:
    try:
        metadata = read_metadata_safely(_source(reader))
    except UnsafeCheckpointError as err:
        _METADATA_REFUSALS.append(err)
        raise
    metadata.storage_meta.load_id = reader.load_id  # what FileSystemReader.read_metadata sets
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with a safe `.metadata` unpickler and weights-only values (module doc)."""

    def read_metadata(self) -> dcp_metadata.Metadata:
        return safe_read_metadata(self)

    def read_data(self, plan: Any, planner: LoadPlanner) -> Any:
        return super().read_data(plan, WeightsOnlyPlanner(planner, _source(self)))  # type: ignore[arg-type]


@contextlib.contextmanager
def composer_reads_sharded_safely() -> Iterator[None]:
    """While active, Composer's sharded loads read `.metadata` and values as SafeFileSystemReader does.

    Composer 0.32 reads every sharded checkpoint (local, or downloaded from an object store by
    `DistCPObjectStoreReader`, a subclass) through `FileSystemReaderWithValidation`; replacing its two read
    methods covers both, including the bytes Composer hands the planner it chose."""
    reader_class = composer_checkpoint.FileSystemReaderWithValidation
    original_metadata, original_data = reader_class.read_metadata, reader_class.read_data

    def read_data(self: FileSystemReader, plan: Any, planner: LoadPlanner) -> Any:
        return original_data(self, plan, WeightsOnlyPlanner(planner, _source(self)))

    reader_class.read_metadata = safe_read_metadata  # type: ignore[method-assign]
    reader_class.read_data = read_data  # type: ignore[method-assign]
    try:
        yield
    finally:
        reader_class.read_metadata = original_metadata  # type: ignore[method-assign]
        reader_class.read_data = original_data  # type: ignore[method-assign]


@contextlib.contextmanager
def unwrapped_refusals() -> Iterator[None]:
    """DCP wraps whatever a read raises into a CheckpointException (a BaseException listing each rank's
    error); a refusal from this module is re-raised as itself, so the caller sees which file and why."""
    _METADATA_REFUSALS.clear()
    try:
        yield
    except CheckpointException as err:
        for failure, _trace in err.failures.values():
            if isinstance(failure, UnsafeCheckpointError):
                raise failure from err
        if _METADATA_REFUSALS:  # swallowed by torch 2.11's DCP (see _METADATA_REFUSALS)
            raise _METADATA_REFUSALS[-1] from err
        raise
    finally:
        _METADATA_REFUSALS.clear()


def consolidate_sharded_checkpoint(folder: str | Path) -> dict[str, Any]:
    """The full state dict of a sharded checkpoint, in this process alone (no process group): every
    shard read and placed at its offsets, the same nesting Composer saved (`{"state": ..., "rng": ...}`).

    It holds the whole checkpoint in memory (~14 GB for SD2-base with EMA and AdamW)."""
    state: dict[str, Any] = {}
    reader = SafeFileSystemReader(str(folder))
    with unwrapped_refusals():
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def read_full_checkpoint(path: str | Path) -> dict[str, Any]:
    """A local checkpoint as one full state dict: a `.pt` file through the weights-only unpickler, a
    sharded folder consolidated (both safe, see the module doc)."""
    if Path(path).is_dir():
        return consolidate_sharded_checkpoint(path)
    loaded = load_weights_only(path)
    if not isinstance(loaded, dict) or not isinstance(loaded.get("state"), dict):
        raise UnsafeCheckpointError(
            f"{path} is a torch file but not a checkpoint of `python -m train fit` (no training state in "
            "it); pass one of its checkpoints or its save folder"
        )
    return loaded


ALGORITHMS_KEY = "algorithms"
OPAQUE_ALGORITHMS_FQN = "state.algorithms"  # how a checkpoint with an untraversed algorithm list names it


def traversable_algorithms(state_dict: dict[str, Any]) -> None:
    """Composer's `state["algorithms"]` list of `(name, state)` tuples, in place as `[name, state]` lists,
    which DCP traverses (torch 2.7 `_traverse._is_terminal`: a list of tuples is one leaf). Composer's
    loader reads either (`dict(pairs)`), and so does `train.ema.algorithm.select_unet_weights`."""
    state = state_dict.get("state")
    if isinstance(state, dict) and isinstance(state.get(ALGORITHMS_KEY), list):
        state[ALGORITHMS_KEY] = [
            list(pair) if isinstance(pair, tuple) else pair for pair in state[ALGORITHMS_KEY]
        ]


class AlgorithmsTraversingSavePlanner(DefaultSavePlanner):
    """DCP's save planner, writing algorithm state (the EMA shards) entry by entry, from every rank."""

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        traversable_algorithms(state_dict)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)


class AlgorithmsTraversingLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading algorithm state entry by entry when the checkpoint was written so (the
    EMA shards, resharded in place), or as one value from a checkpoint that holds it as one.

    Sharded tensors stay as they are (`flatten_sharded_tensors=False`): DCP's flattening drops one with no
    local shard, and a rank holding none of a parameter would then miss its key, which DCP takes for a
    torch <= 2.3 checkpoint and re-flattens the whole state the old way. Nothing here nests them (2-D)."""

    def __init__(self) -> None:
        super().__init__(flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        if metadata is None or OPAQUE_ALGORITHMS_FQN not in metadata.state_dict_metadata:
            traversable_algorithms(state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def fsdp_checkpoint_options(fmt: str) -> dict[str, Any]:
    """The FSDP config entries (Composer's `parallelism_config.fsdp`) that pick the checkpoint format.

    Sharded: each rank writes its shards, the EMA's included (planners above); values every rank holds
    (EMA buffers, timestamps) go to whichever rank has written least so far
    (`dedup_save_to_lowest_rank=False`), not all to rank 0."""
    if fmt != "sharded":
        return {"state_dict_type": "full"}
    return {
        "state_dict_type": "sharded",
        "save_planner": AlgorithmsTraversingSavePlanner(dedup_save_to_lowest_rank=False),
        "load_planner": AlgorithmsTraversingLoadPlanner(),
    }


@contextlib.contextmanager
def load_path_in_format(path: str | None, fmt: str) -> Iterator[str | None]:
    """`path` (a resolved checkpoint: a `.pt` file or a sharded folder) as a run writing `fmt` checkpoints
    can hand it to Composer, which loads only the format it writes: a sharded checkpoint is consolidated
    into a scratch `.pt` for a full run (one rank, no FSDP, `make export`), a full one rewritten as a
    one-file sharded folder for a sharded run. Either is a one-time cost at start (the whole checkpoint in
    memory and on local disk, on each rank); the scratch copy is removed when the block ends."""
    is_sharded = path is not None and not path.endswith(CHECKPOINT_SUFFIX)
    if path is None or is_sharded == (fmt == "sharded"):
        yield path
        return
    scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))  # private (0700)
    log.warning("%s is a %s checkpoint and this run writes %s ones: converting it once", path,
                "sharded" if is_sharded else "full", fmt)  # fmt: skip
    try:
        with fetched_checkpoint(path) as local:
            if is_sharded:
                converted = scratch / f"consolidated{CHECKPOINT_SUFFIX}"
                torch.save(consolidate_sharded_checkpoint(local), converted)
            else:
                converted = scratch / "sharded"
                state = load_weights_only(local, source=path)
                planner = AlgorithmsTraversingSavePlanner()  # the layout a sharded run writes and loads
                dcp_save(
                    state, storage_writer=FileSystemWriter(str(converted)), planner=planner, no_dist=True
                )
                del state
        yield str(converted)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def composer_loads_safely(path: str | None, fmt: str) -> Iterator[str | None]:
    """Around `Trainer(...)`: the load_path to hand Composer (`load_path_in_format`), with every load
    Composer makes going through the weights-only unpickler and the safe sharded reader."""
    with (
        load_path_in_format(path, fmt) as load_path,
        composer_loads_weights_only(path),
        composer_reads_sharded_safely(),
        unwrapped_refusals(),
    ):
        yield load_path
