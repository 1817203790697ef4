"""`python -m train eval-images` on the session run's export (issue 25's done-when): three guidance scales,
metrics.json, the FID-vs-CLIP plot, images with their prompts, the reference features cached; the same
seed regenerates the same images."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shared.runtime.exits import DEBUG_ENV
from tests.train.conftest import REPO_ROOT, TORCHRUN
from train.eval.images import ImageEvalSpec, generate, load_pipeline, load_prompts, run_eval_images

NUM_IMAGES = 4
STEPS = 3


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle on a blue background\na yellow square\n\na green triangle\na black dot\n")
    return path


@pytest.mark.slow
def test_eval_images_writes_metrics_plot_and_images(
    exported_model: str, prompts_file: Path, reference_images: str, inception_weights: str, clip_model: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    out, cache = tmp_path / "eval", tmp_path / "fid-cache"
    argv = [
        sys.executable, "-m", "train", "eval-images", exported_model, "--prompts-from", str(prompts_file),
        "--reference", reference_images, "--num-images", str(NUM_IMAGES), "--guidance", "1.5,4,8",
        "--steps", str(STEPS), "--seed", "0", "--inception-weights", inception_weights,
        "--clip-model", clip_model, "--out", str(out), "--cache-dir", str(cache), "--batch-size", "3",
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=_env(env))
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((out / "metrics.json").read_text())
    assert sorted(report["guidance"]) == ["1.5", "4", "8"]
    for values in report["guidance"].values():
        assert set(values) >= {"fid", "kid", "clip_score"}
        assert values["fid"] >= 0 and 0 <= values["clip_score"] <= 100
    assert report["kid_subset_size"] == NUM_IMAGES and not report["reference_cached"]
    assert (out / "fid_vs_clip.png").stat().st_size > 1000
    prompts = load_prompts(str(prompts_file), NUM_IMAGES)
    for scale in ("1.5", "4", "8"):
        folder = out / "images" / scale
        assert sorted(p.name for p in folder.glob("*.png")) == [f"{i}.png" for i in range(NUM_IMAGES)]
        assert [(folder / f"{i}.txt").read_text().strip() for i in range(NUM_IMAGES)] == prompts
    assert "guidance 4:" in done.stdout

    # The same seed regenerates the same images: bit for bit with the same batches; on another split (as
    # on another rank count) to the rounding of batched convolutions.
    pipe = load_pipeline(exported_model, "cpu")
    for name, batch, order in (("same", 3, [0, 1, 2, 3]), ("split", 1, [3, 1, 0, 2])):
        spec = ImageEvalSpec(
            exported_model, str(prompts_file), reference_images, inception_weights, clip_model,
            str(tmp_path / name), NUM_IMAGES, [4.0], STEPS, 0, batch_size=batch,
        )  # fmt: skip
        generate(pipe, prompts, order, spec, 4.0)
    for i in range(NUM_IMAGES):
        first = out / "images/4" / f"{i}.png"
        assert (tmp_path / "same/images/4" / f"{i}.png").read_bytes() == first.read_bytes()
        assert pixel_diff(tmp_path / "split/images/4" / f"{i}.png", first) <= 2

    # A second run on the same reference reads its features from the cache (tests/train/eval/test_quality.py
    # counts the extractions); here: the cache file this run left.
    assert len(list(cache.glob("reference-*.pt"))) == 1


def pixel_diff(a: Path, b: Path) -> int:
    import numpy as np
    from PIL import Image

    return int(np.abs(np.asarray(Image.open(a), np.int16) - np.asarray(Image.open(b), np.int16)).max())


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}


def test_eval_images_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num-images"):
        ImageEvalSpec("m", "p", "r", "i", "c", "o", num_images=1)
    with pytest.raises(ValueError, match="guidance"):
        ImageEvalSpec("m", "p", "r", "i", "c", "o", guidance=[0.5])
    with pytest.raises(ValueError, match="--device must be auto, cpu or gpu"):
        ImageEvalSpec("m", "p", "r", "i", "c", "o", device="cuda:0")
    with pytest.raises(ValueError, match="export"):
        load_pipeline(str(tmp_path), "cpu")
    bad = ImageEvalSpec("m", "p", str(tmp_path), str(tmp_path / "none.pth"), str(tmp_path), "o")
    with pytest.raises(ValueError, match="inception-weights"):  # refused before any image is generated
        run_eval_images(bad)
    (tmp_path / "few.txt").write_text("one\n")
    with pytest.raises(ValueError, match="fewer than --num-images"):
        load_prompts(str(tmp_path / "few.txt"), 2)


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_split_the_prompts(
    exported_model: str, prompts_file: Path, reference_images: str, inception_weights: str, clip_model: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    """Under torchrun each rank writes its share (i % world); with one image per call the images are the
    single-process ones bit for bit, and rank 0 alone writes metrics.json."""
    out = tmp_path / "ranks"
    argv = [
        *TORCHRUN, "--standalone", "--nnodes=1", "--nproc-per-node=2",
        "-m", "train", "eval-images", exported_model, "--prompts-from", str(prompts_file),
        "--reference", reference_images, "--num-images", "3", "--guidance", "2", "--steps", str(STEPS),
        "--inception-weights", inception_weights, "--clip-model", clip_model, "--out", str(out),
        "--cache-dir", str(tmp_path / "cache"), "--batch-size", "1",
    ]  # fmt: skip
    done = subprocess.run(
        argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=_env({"OMP_NUM_THREADS": "1"})
    )
    assert done.returncode == 0, "\n".join(line for line in done.stderr.splitlines() if "│" not in line)[
        -6000:
    ]
    assert "rank 0 wrote 2 images" in done.stderr and "rank 1 wrote 1 images" in done.stderr
    assert list(json.loads((out / "metrics.json").read_text())["guidance"]) == ["2"]
    spec = ImageEvalSpec(
        exported_model, str(prompts_file), reference_images, inception_weights, clip_model,
        str(tmp_path / "one"), 3, [2.0], STEPS, 0, batch_size=1,
    )  # fmt: skip
    generate(load_pipeline(exported_model, "cpu"), load_prompts(str(prompts_file), 3), [0, 1, 2], spec, 2.0)
    for i in range(3):
        assert (out / "images/2" / f"{i}.png").read_bytes() == (
            tmp_path / "one/images/2" / f"{i}.png"
        ).read_bytes()


def test_a_node_without_gpus_in_a_job_of_several_nodes_says_so_before_joining(tmp_path: Path) -> None:
    """Rank 3 of 2 nodes with no GPU visible: one line naming the node and both fixes, exit 2, before it
    joins (MASTER_PORT leads nowhere) or generates anything. Every rank joins with gloo (the group carries
    one barrier), so no node's backend can differ from its peers'."""
    argv = [
        sys.executable, "-m", "train", "eval-images", str(tmp_path / "model"), "--prompts-from", "p.txt",
        "--reference", "ref", "--inception-weights", "w.pth", "--clip-model", "clip",
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    env = _env({
        DEBUG_ENV: "0", "CUDA_VISIBLE_DEVICES": "", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "RANK": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9",
    })  # fmt: skip
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = [each for each in done.stderr.strip().splitlines() if " INFO " not in each]
    assert f"--device auto but this node ({socket.gethostname()}) sees no GPU, in a job of 2 nodes" in line
    assert line.endswith("or pass --device cpu for a CPU job on several nodes")
    assert not any(tmp_path.iterdir())
