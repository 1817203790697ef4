"""`make demo` (`python -m train demo`): the whole product on the bundled sample data, on CPU, in minutes.

1. build the sample data (synthetic coloured shapes, real img2dataset webdataset tars);
2. encode it with the tiny preset (the real encode job, in-process);
3. train the tiny U-Net on the 64 px latents (the real Composer train job, in-process);
4. export the EMA weights to a diffusers folder and generate from it with `StableDiffusionPipeline`;
5. plot the loss curve; print where everything went.

Rerunning is cheap: encode finds its output up to date and training resumes from its last checkpoint
(already finished, so it stops at once); pass `--fresh` to start over.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from shared.config import load_config

DEMO_PROMPTS = (
    "a red circle on a blue background",
    "a yellow square on a green background",
    "a white triangle on a black background",
    "a blue circle on a yellow background",
)
IMAGES_PER_PROMPT = 3
SAMPLE_STEPS = 25
GUIDANCE = 4.0


@dataclass
class DemoPaths:
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "sample-data"

    @property
    def encoded(self) -> Path:
        return self.root / "encoded"

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def pipeline(self) -> Path:
        return self.root / "pipeline"

    @property
    def samples(self) -> Path:
        return self.root / "samples.png"

    @property
    def loss(self) -> Path:
        return self.root / "loss.png"

    def bucket_samples(self, bucket: str) -> Path:
        """The grid at one aspect-ratio bucket's shape ("HxW" px), beside the square samples.png."""
        return self.root / f"samples-{bucket}.png"


def bucket_sample_shapes(pipeline: Path) -> dict[str, tuple[int, int]]:
    """ "HxW" -> (height, width) px of the landscape and the portrait bucket the exported U-Net saw most (its
    buckets.json, written by export for bucketed data); {} for a square-only model."""
    from shared.buckets import landscape_and_portrait, parse_bucket
    from train.export.pipeline import BUCKETS_FILE

    path = pipeline / BUCKETS_FILE
    if not path.exists():
        return {}
    counts = json.loads(path.read_text())["buckets"]
    return {name: parse_bucket(name) for name in landscape_and_portrait(counts)}


def build_data(paths: DemoPaths) -> Path:
    from encode.sample_data import build_webdataset

    target = paths.data / "webdataset"
    if not any(target.glob("*.tar")):
        build_webdataset(target)
    return target


def encode_data(paths: DemoPaths, source: Path, dataset: str = "sample") -> None:
    from encode.config import EncodeConfig
    from encode.pipeline import RankInfo, run_rank
    from encode.plan.claims import claimed_rank
    from encode.process.encoders import load_encoders
    from encode.publish.finalize import publish
    from encode.report import print_publish, print_rank
    from shared.manifest import Layout

    start = time.perf_counter()
    cfg = load_config(
        EncodeConfig, dataset, [f"source.uri={source}", f"output.uri={paths.encoded}"], kind="datasets"
    )
    with claimed_rank(Layout(cfg.output.uri), 0, 1, f"encode {cfg.name} (make demo)"):
        encoders = load_encoders(cfg)
        print_rank(run_rank(cfg, RankInfo(0, 1), encoders))
        print_publish(publish(cfg, encoders), cfg, time.perf_counter() - start)


def train_model(paths: DemoPaths, max_duration: str | None) -> None:
    from train.config import TrainConfig
    from train.loop.prepare import RunFinishedError
    from train.loop.trainer import fit

    overrides = [f"data.uri={paths.encoded}", f"save_folder={paths.train}"]
    if max_duration:
        overrides.append(f"max_duration={max_duration}")
    try:
        fit(load_config(TrainConfig, "tiny", overrides, kind="train"))
    except RunFinishedError:  # a rerun of the demo: its run is done, the rest is redone from it
        print(f"training in {paths.train} already finished: reusing it (--fresh starts over)", flush=True)


def export_and_generate(paths: DemoPaths) -> list[Path]:
    """Export the run, then render the demo prompts into samples.png; a bucketed run also into one grid
    per landscape / portrait bucket (issue 32: the model draws at the shapes it trained on). Returns those
    extra grids."""
    import torch
    from diffusers import StableDiffusionPipeline

    from train.export.pipeline import export_pipeline
    from train.export.samples import save_grid

    result = export_pipeline(str(paths.train), str(paths.pipeline))
    # low_cpu_mem_usage=False: the tiny model needs no `accelerate` (not a dependency), and says so quietly
    pipe = StableDiffusionPipeline.from_pretrained(
        str(paths.pipeline), local_files_only=True, low_cpu_mem_usage=False
    )
    pipe.set_progress_bar_config(disable=True)
    step = re.search(r"-ba(\d+)", result.checkpoint)
    title = f"{'step ' + step.group(1) + ', ' if step else ''}guidance {GUIDANCE:g}, {SAMPLE_STEPS} steps"
    grids = {paths.samples: ("", None), **{paths.bucket_samples(n): (f", {n} px", hw) for n, hw in
             bucket_sample_shapes(paths.pipeline).items()}}  # fmt: skip
    for path, (shape, size) in grids.items():
        images = pipe(
            [p for p in DEMO_PROMPTS for _ in range(IMAGES_PER_PROMPT)],
            num_inference_steps=SAMPLE_STEPS,
            guidance_scale=GUIDANCE,
            generator=torch.Generator().manual_seed(0),  # the same starting noise seed for every grid
            output_type="pt",
            **({"height": size[0], "width": size[1]} if size else {}),
        ).images
        pixels = (images * 255).round().to(torch.uint8)
        caption = f"{title}{shape} ({result.weights})"
        save_grid(pixels, str(path), IMAGES_PER_PROMPT, DEMO_PROMPTS, caption)
    return [path for path in grids if path != paths.samples]


def plot_loss(paths: DemoPaths) -> None:
    """The run's loss plot (train/eval/plot.py: training loss, and the held-out loss when the run has one)."""
    from train.eval.plot import plot_losses

    plot_losses(paths.train / "metrics.jsonl", paths.loss, "tiny U-Net on the sample data")


def run_demo(
    out: Path, max_duration: str | None = None, fresh: bool = False, dataset: str = "sample"
) -> DemoPaths:
    """Every step of the demo into `out`; prints progress and where everything went. `dataset`: the
    jobs/datasets config to encode the sample data with; another than `sample` (e.g. sample-buckets) goes
    into `<out>-<its suffix>` (outputs/demo-buckets), so it never resumes the square demo's run."""
    if dataset != "sample":
        out = Path(f"{out}-{dataset.removeprefix('sample-')}")
    paths = DemoPaths(Path(out))
    if fresh:
        shutil.rmtree(paths.root, ignore_errors=True)
    start = time.perf_counter()
    step = lambda name: print(f"\n== {name} ({time.perf_counter() - start:.0f} s)", flush=True)  # noqa: E731
    step("1/4 sample data")
    source = build_data(paths)
    step(f"2/4 encode ({dataset}: tiny preset, 64 + 128 px)")
    encode_data(paths, source, dataset)
    step("3/4 train (tiny U-Net, 64 px latents)")
    train_model(paths, max_duration)
    step("4/4 export + generate with diffusers' StableDiffusionPipeline")
    bucket_grids = export_and_generate(paths)
    plot_loss(paths)
    print(f"\ndone in {time.perf_counter() - start:.0f} s")
    print(f"  sample data      {paths.data}")
    print(f"  encoded dataset  {paths.encoded}  (manifest.json, metrics.json, MDS shards per resolution)")
    print(f"  checkpoints      {paths.train}  (metrics.jsonl, logs/, samples/)")
    print(f"  diffusers model  {paths.pipeline}  (StableDiffusionPipeline.from_pretrained)")
    print(f"  generated grid   {paths.samples}  (one labelled row per prompt: {'; '.join(DEMO_PROMPTS)})")
    for grid in bucket_grids:  # bucketed data: the same prompts at a landscape and a portrait bucket
        print(f"  bucket grid      {grid}  (the same prompts at {grid.stem.removeprefix('samples-')} px)")
    print(f"  loss curve       {paths.loss}")
    return paths
