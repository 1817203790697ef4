"""`python -m train eval-images`: generate with the exported diffusers pipeline at several guidance scales,
then FID and KID against reference images and CLIP score against the prompts (train/eval/quality.py).

Image i comes from prompt i and a generator seeded by (seed, i) alone, at every guidance scale, so the same
seed regenerates the same images on any rank count and batch size, and the scales differ only in guidance.
Images are written as `<out>/images/<guidance>/<i>.png` with the prompt beside it as `<i>.txt`; the metrics
are computed from those PNG files' pixels. Under torchrun the prompts are split over ranks (i % world);
rank 0 computes the metrics once every rank has written its images.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shared import storage
from shared.buckets import parse_bucket
from shared.config import ConfigError
from shared.runtime.device import check_node_sees_gpu, local_cuda_device, nodes_in_launch, resolve_device_kind
from train.data.draws import seed_of
from train.eval.report import guidance_name, score_and_report

log = logging.getLogger(__name__)


@dataclass
class ImageEvalSpec:
    model: str  # an exported diffusers folder (`python -m train export`), local or s3://
    prompts_from: str  # an encoded dataset (its captions, in stored order) or a text file (a prompt a line)
    reference: (
        str  # a folder of images, a webdataset .tar or img2dataset .parquet shards (or folders of them)
    )
    inception_weights: str  # the standard FID Inception weights file
    clip_model: str  # an open_clip model folder (`local-dir:` layout)
    out: str
    num_images: int = 10000
    guidance: list[float] = field(default_factory=lambda: [1.5, 4.0, 8.0])
    steps: int = 50
    seed: int = 0
    batch_size: int = 8
    num_reference: int = 0  # reference images used (0: all)
    cache_dir: str = ""  # reference feature cache; "": <tmp>/sd-pretrain-fid-<uid>
    size: str = ""  # "HxW" px to generate at (a bucket trained on); "": the pipeline's own (square) size
    device: str = "auto"  # auto (this rank's GPU if one is visible) | cpu | gpu

    def __post_init__(self) -> None:
        if self.num_images < 2:
            raise ConfigError(f"--num-images must be >= 2 (FID needs two images), got {self.num_images}")
        if not self.guidance or any(g < 1.0 for g in self.guidance):
            raise ConfigError(f"--guidance must list scales >= 1 (e.g. 1.5,4,8), got {self.guidance}")
        if self.steps < 1 or self.batch_size < 1:
            raise ConfigError("--steps and --batch-size must be >= 1")
        if self.device not in ("auto", "cpu", "gpu"):
            raise ConfigError(f"--device must be auto, cpu or gpu, got {self.device!r}")
        if self.size:
            try:
                height, width = parse_bucket(self.size)
            except ValueError as err:
                raise ConfigError(f"--size: {err}") from None
            if height % 8 or width % 8 or not height or not width:
                raise ConfigError(f"--size {self.size}: both sides must be positive multiples of 8 px")

    def hw(self) -> dict[str, int]:
        """The pipeline's height / width arguments ({} : its default size)."""
        if not self.size:
            return {}
        height, width = parse_bucket(self.size)
        return {"height": height, "width": width}


def image_seed(seed: int, index: int) -> int:
    return seed_of("image", seed, index)


def load_prompts(source: str, count: int) -> list[str]:
    """The first `count` prompts: of a text file (one a line), else of an encoded dataset's captions."""
    path = Path(source)
    if path.is_file():
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    else:
        from train.eval.data import read_captions

        prompts = read_captions(source.rstrip("/"), count)
    if len(prompts) < count:
        raise ConfigError(
            f"--prompts-from {source} has {len(prompts)} prompts, fewer than --num-images {count}"
        )
    return prompts[:count]


def load_pipeline(model: str, device: str) -> Any:
    from diffusers import StableDiffusionPipeline

    local = model
    if storage.is_s3(model):
        model_key = hashlib.sha256(model.encode()).hexdigest()[:16]
        local = str(
            storage.download_dir(model, storage.private_temp_dir("sd-pretrain-eval", "--model") / model_key)
        )
    if not (Path(local) / "model_index.json").is_file():
        raise ConfigError(f"{model} is not an exported pipeline folder: run `python -m train export` first")
    pipe = StableDiffusionPipeline.from_pretrained(local, safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def generate(pipe: Any, prompts: list[str], indices: list[int], spec: ImageEvalSpec, scale: float) -> None:
    """Write images `indices` at one guidance scale (and each prompt beside its image)."""
    folder = Path(spec.out) / "images" / guidance_name(scale)
    folder.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(indices), spec.batch_size):
        chunk = indices[start : start + spec.batch_size]
        generators = [torch.Generator().manual_seed(image_seed(spec.seed, i)) for i in chunk]
        images = pipe(
            prompt=[prompts[i] for i in chunk],
            guidance_scale=scale,
            num_inference_steps=spec.steps,
            generator=generators,
            output_type="pil",
            **spec.hw(),
        ).images
        for i, image in zip(chunk, images, strict=True):
            image.save(folder / f"{i}.png")
            (folder / f"{i}.txt").write_text(prompts[i] + "\n")


def rank_and_world() -> tuple[int, int]:
    """This process's rank under torchrun (joins the process group), else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as tdist

    if not tdist.is_initialized():
        # gloo on every rank, GPU or not: the group carries one barrier (the scores wait for every rank's
        # images), so no rank's choice of backend can differ from its peers'.
        tdist.init_process_group("gloo")
    return tdist.get_rank(), world


def device_for_rank(requested: str) -> str:
    """This rank's GPU (LOCAL_RANK), or the CPU with --device cpu or where none is visible; `auto` on a node
    without GPUs in a job of several is refused before the join (every other rank would wait for its CPU)."""
    kind = resolve_device_kind(requested)
    check_node_sees_gpu(requested, kind, nodes_in_launch(), flag="--device ")
    return str(local_cuda_device()) if kind == "gpu" else "cpu"


def check_inputs(spec: ImageEvalSpec) -> None:
    """The files scoring needs exist and have the right layout (the reference holds >= 2 images)."""
    from train.eval.quality import CLIP_CONFIG, INCEPTION_FILE

    if not Path(spec.inception_weights).is_file():
        raise ConfigError(
            f"--inception-weights {spec.inception_weights} is not a file: pass the standard FID Inception "
            f"weights ({INCEPTION_FILE}, the file torch-fidelity downloads)"
        )
    if not (Path(spec.clip_model) / CLIP_CONFIG).is_file():
        raise ConfigError(
            f"--clip-model {spec.clip_model} is not an open_clip model folder ({CLIP_CONFIG} + "
            "open_clip_model.safetensors, as open_clip's `local-dir:` loads it)"
        )
    if not Path(spec.reference).exists():
        raise ConfigError(f"--reference {spec.reference} does not exist")


def run_eval_images(spec: ImageEvalSpec) -> dict[str, Any] | None:
    """Generate, then (rank 0) score; returns metrics.json's content on rank 0, None on the others."""
    device = device_for_rank(spec.device)  # before joining the other ranks
    check_inputs(spec)  # before hours of generation, not after
    rank, world = rank_and_world()
    prompts = load_prompts(spec.prompts_from, spec.num_images)
    pipe = load_pipeline(spec.model, device)
    mine = list(range(rank, spec.num_images, world))
    for scale in spec.guidance:
        generate(pipe, prompts, mine, spec, scale)
        log.info("rank %d wrote %d images at guidance %s", rank, len(mine), guidance_name(scale))
    del pipe
    if world > 1:
        import torch.distributed as tdist

        tdist.barrier()
    if rank != 0:
        return None
    return score_and_report(spec, prompts, device)
