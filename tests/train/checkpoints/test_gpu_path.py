"""The GPU path on CPU ranks (issue 22 items 1-2): `train fit` with Composer's own FSDP (SHARD_GRAD_OP and
FULL_SHARD) and channels_last on 2 gloo ranks, and everything it saves consolidates to the uninterrupted run.

The uninterrupted reference trains once per session (1 rank, no FSDP, NCHW, full checkpoints at batches 4
and 8). Every other run either trains uninterrupted in another layout or resumes a batch-4 checkpoint in
another layout, and its checkpoints are compared with the reference's tensor by tensor: training weights,
EMA, AdamW exp_avg and exp_avg_sq, every 4-D conv kernel included, to float reduction order. The runs
cover fsdp on/off x channels_last on/off x checkpoint_format full/sharded:

| run | starts from | ranks | fsdp | channels_last | format |
|---|---|---|---|---|---|
| reference | scratch | 1 | off | off | full |
| sharded | scratch | 2 | SHARD_GRAD_OP | on | sharded |
| same_layout | sharded@4 | 2 | FULL_SHARD (fsdp=null: 2 ranks) | on | sharded |
| nchw_full | sharded@4 | 2 | SHARD_GRAD_OP | off | full |
| one_rank | sharded@4 | 1 | off (fsdp=null: 1 rank, as the SD2 recipes on one GPU) | on | full |
| from_full | reference@4 | 2 | SHARD_GRAD_OP | off | sharded |
| from_full_cl | reference@4 | 2 | SHARD_GRAD_OP | on | full |
| speed_switches | sharded@4 | 2 | SHARD_GRAD_OP, compiled (aot_eager), speed switches below | on | sharded |

plus `export --weights ema|training` of the sharded run. Each 2-rank run is one `torchrun` launch of the
real job; the 1-rank runs train in this process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.train.conftest import (
    REPO_ROOT,
    TORCHRUN,
    single_threaded_torch,
    tiny_config,
    tiny_overrides,
    write_fake_dataset,
)
from train.checkpoints.files import LATEST_NAME
from train.checkpoints.sharded import read_full_checkpoint
from train.ema.algorithm import select_unet_weights
from train.export.pipeline import export_pipeline
from train.loop.trainer import fit

pytestmark = [pytest.mark.slow, pytest.mark.dist]

RUN_TIMEOUT_S = 420
ROWS = 48  # 6 global batches of 8 an epoch: batch 4 is mid-epoch, batch 8 in epoch 1
SETTINGS = ["samples.enabled=false", "save_interval=4ba", "ema.smoothing=0.9", "device=cpu"]
FSDP = ["fsdp=true", "fsdp_sharding_strategy=SHARD_GRAD_OP"]
# Float reduction order: FSDP reduce-scatters and shards the clipping norm where the 1-rank run sums in one
# place. Each tensor's max difference is measured against its own scale (max |value|), because AdamW's
# exp_avg_sq is ~1e-7 here and an absolute tolerance would pass it scrambled. Measured over every tensor of
# every run here: at most 7.4e-6 of the scale (a norm bias); a permuted conv kernel is off by its own size.
SCALE_TOL = 1e-4
CONV_KERNELS = 20  # 4-D tensors per table in the tiny U-Net, at least


def two_ranks(data: str, save: Path, max_batches: int, *extra: str) -> str:
    """`python -m train fit tiny` on 2 CPU ranks under torchrun; returns its log."""
    cache = save.parent / f"cache-{save.name}"
    overrides = tiny_overrides(data, save, cache, f"max_duration={max_batches}ba")
    argv = [
        *TORCHRUN, "--standalone", "--nnodes=1", "--nproc-per-node=2",
        "-m", "train", "fit", "tiny", *overrides, *SETTINGS, *extra,
    ]  # fmt: skip
    # torchrun does not set NODE_RANK, which Composer reads when it loads a checkpoint on several ranks.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NODE_RANK": "0"}
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    return log


def one_rank(data: str, save: Path, max_batches: int, *extra: str) -> None:
    cfg = tiny_config(data, save, save.parent / f"cache-{save.name}", f"max_duration={max_batches}ba",
                      *SETTINGS, *extra)  # fmt: skip
    with single_threaded_torch():
        fit(cfg)


def checkpoint_at(save: Path, batch: int) -> Path:
    """The batch's checkpoint: `ep*-ba{batch}-rank0.pt` (full) or the folder `ep*-ba{batch}` (sharded)."""
    (found,) = [p for p in save.glob(f"ep*-ba{batch}*") if p.name.split("-")[1] == f"ba{batch}"]
    return found


def resume_from(checkpoint: Path, save: Path) -> None:
    """A save folder holding `checkpoint` as its latest, as if that run had stopped right after it."""
    save.mkdir(parents=True)
    if checkpoint.is_dir():
        shutil.copytree(checkpoint, save / checkpoint.name)
    else:
        shutil.copyfile(checkpoint, save / checkpoint.name)
    (save / LATEST_NAME).symlink_to(checkpoint.name)


def every_tensor(path: Path) -> dict[str, torch.Tensor]:
    """Training weights, EMA and AdamW moments of a checkpoint (file or sharded folder), by name."""
    state = read_full_checkpoint(path)["state"]
    out: dict[str, torch.Tensor] = {}
    for which in ("training", "ema"):
        weights, what = select_unet_weights(state, which)
        assert what == which
        out.update({f"{which}:{name}": tensor for name, tensor in weights.items()})
    for name, moments in state["optimizers"]["AdamW"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}:{name}"] = moments[key]
    return out


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """name -> max abs difference / max |expected|, where over SCALE_TOL (empty: equal to reduction order)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:5]
    bad = {}
    for name, expected in want.items():
        actual = got[name].float()
        assert actual.shape == expected.shape, name
        scale = float(expected.float().abs().max()) or 1.0
        relative = float((actual - expected.float()).abs().max()) / scale
        if relative > SCALE_TOL:
            bad[name] = relative
    return bad


def assert_same_tensors(path: Path, reference: Path) -> None:
    got, want = every_tensor(path), every_tensor(reference)
    for kind in ("training", "ema", "exp_avg", "exp_avg_sq"):
        kernels = [n for n, t in want.items() if n.startswith(f"{kind}:") and t.dim() == 4]
        assert len(kernels) >= CONV_KERNELS, f"only {len(kernels)} conv kernels in {kind}"
    bad = differences(got, want)
    assert not bad, f"{len(bad)} tensors of {path} differ, e.g. {sorted(bad.items())[:4]}"


class Runs:
    """The session's runs, trained once (module doc's table)."""

    def __init__(self, base: Path):
        self.base = base
        self.data = str(base / "data")
        write_fake_dataset(self.data, n=ROWS)
        self.reference = base / "reference"
        one_rank(self.data, self.reference, 8)
        self.sharded = base / "sharded"
        self.sharded_log = two_ranks(self.data, self.sharded, 8, *FSDP, "channels_last=true",
                                     "checkpoint_format=sharded")  # fmt: skip

    def resumed(self, name: str, start: Path, ranks: int, *extra: str) -> Path:
        save = self.base / name
        resume_from(start, save)
        if ranks == 2:
            log = two_ranks(self.data, save, 8, *extra)
            assert "autoresume: continuing from" in log
            if "model.keep_channels_last=true" in extra:  # applied, not silently skipped under FSDP
                assert "model.keep_channels_last: {'group_norms': " in log
        else:
            one_rank(self.data, save, 8, *extra)
        assert (save / LATEST_NAME).resolve() == checkpoint_at(save, 8).resolve()
        return save


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("gpu-path"))


def test_sharded_run_saves_what_the_uninterrupted_run_holds(runs: Runs) -> None:
    """Composer's FSDP on 2 CPU ranks, NHWC inputs: its sharded checkpoints consolidate to the reference."""
    assert "channels_last: NHWC inputs" in runs.sharded_log
    # Every rank's saver removes the pointer and rank 0 remakes it: it must survive (autoresume reads it).
    assert (runs.sharded / LATEST_NAME).resolve() == checkpoint_at(runs.sharded, 8).resolve()
    for batch in (4, 8):
        folder = checkpoint_at(runs.sharded, batch)
        assert folder.is_dir() and len(list(folder.glob("*.distcp"))) == 2, "not sharded over 2 ranks"
        assert_same_tensors(folder, checkpoint_at(runs.reference, batch))


def test_sharded_run_exports_the_uninterrupted_runs_weights(runs: Runs, tmp_path: Path) -> None:
    want = every_tensor(checkpoint_at(runs.reference, 8))
    for which in ("ema", "training"):
        out = tmp_path / which
        assert export_pipeline(str(runs.sharded), str(out), weights=which).weights == which
        got = load_file(out / "unet" / "diffusion_pytorch_model.safetensors")
        expected = {n.split(":", 1)[1]: t for n, t in want.items() if n.startswith(f"{which}:")}
        assert sum(t.dim() == 4 for t in got.values()) >= CONV_KERNELS
        assert not differences({k.removeprefix("unet."): v for k, v in got.items()},
                               {k.removeprefix("unet."): v for k, v in expected.items()})  # fmt: skip


@pytest.mark.parametrize(
    ("name", "start", "ranks", "layout"),
    [
        ("same_layout", "sharded", 2, ("fsdp=null", "fsdp_sharding_strategy=FULL_SHARD", "channels_last=true",
                                       "checkpoint_format=sharded")),
        ("nchw_full", "sharded", 2, (*FSDP, "channels_last=false", "checkpoint_format=full")),
        ("one_rank", "sharded", 1, ("fsdp=null", "channels_last=true")),
        ("from_full", "reference", 2, (*FSDP, "channels_last=false", "checkpoint_format=sharded")),
        ("from_full_cl", "reference", 2, (*FSDP, "channels_last=true", "checkpoint_format=full")),
        # issue 30's speed switches: low-precision norms and the U-Net compiled under per-block FSDP
        # (aot_eager: inductor's graphs without its C++ compiling), its activations kept channels_last
        # (GroupNorm over a grouped view, every conv's input and gradient NHWC), resumed from the eager run
        ("speed_switches", "sharded", 2, (*FSDP, "channels_last=true", "checkpoint_format=sharded",
                                          "model.low_precision_norms=true", "compile=true",
                                          "compile_backend=aot_eager", "model.keep_channels_last=true")),
    ],
)  # fmt: skip
def test_resume_in_another_layout_matches_the_uninterrupted_run(
    runs: Runs, name: str, start: str, ranks: int, layout: tuple[str, ...]
) -> None:
    """A batch-4 checkpoint resumed to batch 8 in another layout ends where the reference ended."""
    save = runs.resumed(name, checkpoint_at(getattr(runs, start), 4), ranks, *layout)
    assert_same_tensors(checkpoint_at(save, 8), checkpoint_at(runs.reference, 8))
