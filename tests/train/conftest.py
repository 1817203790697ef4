"""Train test fixtures: a small encode output written in the exact layout shared/manifest.py documents.

`write_fake_dataset` writes a dataset in seconds without running the encode job (tests/encode runs that
end to end, and tests/train/test_learning.py trains on its real output): rows go through
`streaming.MDSWriter` + `shared.contract.mds_columns/make_row`, partitions under `<root>/<res>/<part>/`, the
merged index at `<root>/<res>/index.json` and `<root>/versions/<vid>/<res>/index.json`, manifests at
`<root>/manifest.json` and `<root>/versions/<vid>/manifest.json`. Encoder fingerprints and the empty-caption
embedding come from the real tiny encoders, so export's encoder check passes on this data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared import storage
from shared.contract import Shapes, make_row, mds_columns
from shared.manifest import DatasetManifest, Layout, ResolutionInfo, fingerprint
from shared.presets import get_preset
from tests.leftovers import Alone, run_alone, short_folder

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
# torchrun as `train launch` runs it (shared/runtime/exits.py): one line for ranks that stopped on purpose
# instead of torch's traceback box, and its log folder (<tmp>/torchelastic_*) removed when it ends.
TORCHRUN = (PYTHON, "-m", "shared.runtime.exits")


@functools.lru_cache(maxsize=2)
def encoder_facts(preset_name: str) -> tuple[dict[str, str], np.ndarray]:
    """(fingerprints["encoders"], empty-caption embedding) of the preset's encoders, as encode writes them."""
    from shared.models import build_text_encoder, build_vae, weights_fingerprint

    preset = get_preset(preset_name)
    text = build_text_encoder(preset, "transformers")
    empty = text.encode([""])[0].numpy().astype(np.float16)
    return {"vae": weights_fingerprint(build_vae(preset)), "text": text.fingerprint()}, empty


def _write_partition(out_dir: str, shapes: Shapes, keys: range, rng: np.random.Generator) -> None:
    from streaming import MDSWriter

    with MDSWriter(out=out_dir, columns=mds_columns(shapes), size_limit=1 << 16) as writer:
        for i in keys:
            mean = rng.normal(0.0, 1.0, shapes.latent)
            logvar = rng.uniform(-6.0, -2.0, shapes.latent)
            text = rng.normal(0.0, 1.0, shapes.text)
            height, width = shapes.latent[1] * 8, shapes.latent[2] * 8
            geometry = ((height, width), (0.0, 0.0, float(width), float(height))) if shapes.bucketed else None
            writer.write(make_row(f"{i:06d}", f"caption {i}", mean, logvar, text, geometry))


def _merged_index(stream_dir: Path, partitions: list[str]) -> dict[str, Any]:
    shards = []
    for part in partitions:
        index = json.loads((stream_dir / part / "index.json").read_text())
        for shard in index["shards"]:
            for key in ("raw_data", "zip_data"):
                if shard.get(key):
                    shard[key]["basename"] = f"{part}/{shard[key]['basename']}"
            shards.append(shard)
    return {"version": 2, "shards": shards}


def write_fake_dataset(
    root: str | Path,
    preset: str = "tiny",
    resolution: int | tuple[int, ...] = 64,
    n: int = 64,
    version: str = "v1",
    partitions: int = 2,
    seed: int = 0,
    latent_shape: tuple[int, int, int] | None = None,
    text_shape: tuple[int, int] | None = None,
    salt: str = "",
    buckets: dict[str, int] | None = None,
) -> DatasetManifest:
    """Write an encode output (local path or s3:// URI), `n` random rows per resolution; returns its manifest.

    `latent_shape` / `text_shape` override the preset's shapes (contract-mismatch tests); `salt` changes the
    dataset fingerprint without changing rows. Writing a second `version` into the same root adds a version.
    `buckets`: write every resolution bucketed ("HxW" -> rows; `n` is then their sum), as encode's
    transform.buckets does (shards in `<res>/<part>/<HxW>/`, one index per bucket).
    """
    root = str(root)
    p = get_preset(preset)
    resolutions = (resolution,) if isinstance(resolution, int) else tuple(resolution)
    encoders, empty = encoder_facts(preset)
    if text_shape is not None:
        empty = np.zeros(text_shape, dtype=np.float16)
    staging = Path(tempfile.mkdtemp(prefix="fake-ds-"))
    infos = {}
    for res in resolutions:
        shapes = Shapes(latent_shape or p.latent_shape(res), text_shape or p.text_shape())
        if buckets:
            n = sum(buckets.values())
            infos[res] = _write_buckets(staging, version, res, shapes, buckets, partitions, seed)
            continue
        infos[res] = _write_resolution(staging, version, res, shapes, n, partitions, seed, salt)
    dataset_fp = fingerprint(
        {"n": n, "seed": seed, "res": list(resolutions), "salt": salt, "version": version}
    )
    manifest = DatasetManifest(
        version=version,
        created="2024-01-01T00:00:00Z",
        preset=preset,
        scale_factor=p.scale_factor,
        resolutions=infos,
        rejected={},
        samples_read=n,
        fingerprints={"dataset": dataset_fp, "encoders": encoders},
        empty_caption_embedding=empty,
        partitions=[],
        config={"preset": preset, "encoder": {"pretrained": None, "text_backend": "transformers"}},
    )
    layout = Layout(".")
    for rel in (layout.version_manifest(version), layout.manifest):
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_text(json.dumps(manifest.to_json()))
    _publish(staging, root)
    return manifest


def _write_resolution(
    staging: Path, version: str, res: int, shapes: Shapes, n: int, partitions: int, seed: int, salt: str
) -> ResolutionInfo:
    rng = np.random.default_rng(seed + res)
    stream_dir = staging / str(res)
    names = []
    bounds = np.linspace(0, n, partitions + 1).astype(int)
    for part in range(partitions):
        name = f"part{part:05d}-{fingerprint([seed, res, part, salt])[:8]}"
        _write_partition(str(stream_dir / name), shapes, range(bounds[part], bounds[part + 1]), rng)
        names.append(name)
    index = json.dumps(_merged_index(stream_dir, names))
    for rel in (Path(str(res)) / "index.json", Path("versions") / version / str(res) / "index.json"):
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_text(index)
    size = sum(f.stat().st_size for f in stream_dir.rglob("*.mds"))
    return ResolutionInfo(n, shapes, size, 0, fingerprint([seed, res, n, salt]))


def _write_buckets(
    staging: Path, version: str, res: int, square: Shapes, buckets: dict[str, int], partitions: int, seed: int
) -> ResolutionInfo:
    """A bucketed resolution: per partition one folder, per bucket a sub-folder; one index per bucket."""
    rng = np.random.default_rng(seed + res)
    stream_dir = staging / str(res)
    parts = [f"part{part:05d}-{fingerprint([seed, res, part, 'b'])[:8]}" for part in range(partitions)]
    counts, start = {}, 0
    for name, rows in buckets.items():
        height, width = (int(v) for v in name.split("x"))
        shapes = square.for_bucket((height, width), res // square.latent[1])
        bounds = np.linspace(start, start + rows, partitions + 1).astype(int)
        for i, part in enumerate(parts):
            _write_partition(str(stream_dir / part / name), shapes, range(bounds[i], bounds[i + 1]), rng)
        index = json.dumps(_merged_index(stream_dir, [f"{part}/{name}" for part in parts]))
        rel = Path("versions") / version / str(res) / name / "index.json"
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_text(index)
        size = sum(f.stat().st_size for f in stream_dir.glob(f"*/{name}/*.mds"))
        counts[name] = {"num_samples": rows, "bytes": size}
        start += rows
    total = sum(c["bytes"] for c in counts.values())
    shapes = dataclasses.replace(square, bucketed=True)
    return ResolutionInfo(start, shapes, total, 0, fingerprint([seed, res, buckets]), buckets=counts)


def _publish(staging: Path, root: str) -> None:
    """Copy the staged files into `root` (local or s3), the manifest last like encode does."""
    files = sorted(p for p in staging.rglob("*") if p.is_file())
    files.sort(key=lambda p: p.name == "manifest.json")
    for path in files:
        rel = path.relative_to(staging).as_posix()
        target = storage.join(root, rel)
        if storage.is_s3(root):
            storage.write_bytes(target, path.read_bytes())
        else:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------------------------- fixtures
@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Tiny models run fastest on one thread; on a shared 2-core box, two OpenMP threads per process
    contend and a 10 s run takes a minute. Restores the previous setting for the rest of the session."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with single_threaded_torch():
        yield


@pytest.fixture(autouse=True)
def _gpu_kernel_settings_restored() -> Iterator[None]:
    """A test that builds a GPU run's model on the host (device kind "gpu", e.g. StepBench) turns on
    cuDNN autotuning and TF32 matmuls for the process, as a real GPU run should (train/model/kernels.py);
    put them back so a later test in the same process sees the defaults (test_kernels.py asserts a CPU run
    leaves them off)."""
    import torch

    from train.model.kernels import SDPA_BACKENDS, attention_backends_enabled

    before = torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32
    attention = attention_backends_enabled()
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32 = before
        for name, (_, enable) in SDPA_BACKENDS.items():
            enable(name in attention)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A read-only tiny dataset shared by tests that never modify it (64 rows at 64 px, 2 partitions)."""
    root = tmp_path_factory.mktemp("tiny-ds") / "data"
    with single_threaded_torch():
        write_fake_dataset(root)
    return str(root)


# Bucketed tiny data at 64 px (buckets of tiny's bucket_step 16): each bucket a multiple of the tests'
# global batch of 8, so Streaming's per_stream batching drops nothing: 7 batches an epoch.
TINY_BUCKETS = {"80x48": 16, "64x64": 24, "48x80": 16}


@pytest.fixture(scope="session")
def tiny_bucketed_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A read-only bucketed tiny dataset (TINY_BUCKETS rows at 64 px, 2 partitions)."""
    root = tmp_path_factory.mktemp("tiny-ds-buckets") / "data"
    with single_threaded_torch():
        write_fake_dataset(root, buckets=TINY_BUCKETS, seed=11)
    return str(root)


@pytest.fixture(scope="session")
def tiny_dataset_b(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A second read-only tiny dataset (32 rows at 64 px, other rows and fingerprint) to mix with
    `tiny_dataset` (data.streams tests)."""
    root = tmp_path_factory.mktemp("tiny-ds-b") / "data"
    with single_threaded_torch():
        write_fake_dataset(root, n=32, seed=5, salt="b")
    return str(root)


def stream_overrides(*streams: str, **data: Any) -> list[str]:
    """`data.uri=` (cleared) and `data.streams=[...]` from flow-style YAML items such as
    `{uri: /x, proportion: 0.7}`, plus any other `data.<key>=<value>`."""
    items = ", ".join(streams)
    return ["data.uri=", f"data.streams=[{items}]", *(f"data.{k}={v}" for k, v in data.items())]


def tiny_overrides(data: str, save: str | Path, cache: str | Path, *extra: str) -> list[str]:
    """Overrides that make jobs/train/tiny.yaml run on a test dataset in a few seconds (the yaml's batch of
    32 is sized for the demo's learning; tests want several steps per epoch of a 64-row dataset)."""
    return [
        f"data.uri={data}", f"save_folder={save}", f"data.cache_dir={cache}",
        "global_batch_size=8", "device_microbatch_size=4", *extra,
    ]  # fmt: skip


def tiny_config(data: str, save: str | Path, cache: str | Path, *extra: str) -> Any:
    from shared.config import load_config
    from train.config import TrainConfig

    return load_config(TrainConfig, "tiny", tiny_overrides(data, save, cache, *extra), kind="train")


def job_env() -> dict[str, str]:
    """The environment a test's job runs in: single-threaded torch (results match across processes)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_train_cli(args: list[str], temp: Path | None = None, **kwargs: Any) -> subprocess.Popen:
    """Start `python -m train ...` in a subprocess (single-threaded torch: results match across processes);
    `temp`: its TMPDIR (a process the test kills: the `killed_temp` fixture)."""
    env = job_env() if temp is None else {**job_env(), "TMPDIR": str(temp)}
    return subprocess.Popen([PYTHON, "-m", "train", *args], cwd=REPO_ROOT, env=env, **kwargs)


TINY_RUN_EVAL = ("eval.num_samples=8", "eval.timesteps=[100,900]", "eval.seed=3")


class TinyRun:
    """A finished tiny training run: its config, save folder and (closed) Composer trainer."""

    def __init__(self, cfg: Any, trainer: Any):
        self.cfg = cfg
        self.trainer = trainer
        self.save = Path(cfg.save_folder)

    def checkpoint_state(self) -> dict[str, Any]:
        from train.checkpoints.files import read_checkpoint

        return read_checkpoint(self.save / "latest-rank0.pt")["state"]


@pytest.fixture(scope="session")
def tiny_run(tiny_dataset: str, tiny_dataset_b: str, tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    """12 batches of the tiny job (checkpoints, sample grids and a held-out loss at 6 and 12); EMA smoothing
    0.9 so the average visibly differs from the training weights. The eval (8 samples x 2 timesteps of
    `tiny_dataset_b`, 8 forwards each time) is what tests/train/eval reproduces from the checkpoints."""
    from train.loop.trainer import fit

    base = tmp_path_factory.mktemp("tiny-run")
    cfg = tiny_config(
        tiny_dataset, base / "save", base / "cache",
        "max_duration=12ba", "save_interval=6ba", "samples.interval=6ba", "ema.smoothing=0.9",
        "log.tensorboard=true", f"eval.uri={tiny_dataset_b}", "eval.interval=6ba", *TINY_RUN_EVAL,
    )  # fmt: skip
    with single_threaded_torch():
        return TinyRun(cfg, fit(cfg))


# ------------------------------------------------------------------------------------ the newcomer's path
def make_command(target: str, *variables: str) -> list[str]:
    """The command `make <target> VAR=...` runs, read from the Makefile itself (`make -n`), with this
    interpreter's bin folder as the venv's (the .venv bootstrap stamp is taken as done)."""
    bin_dir = str(Path(PYTHON).parent)
    dry = subprocess.run(
        ["make", "-s", "-n", "-C", str(REPO_ROOT), "-o", ".venv/.installed-stamp", f"BIN={bin_dir}",
         target, *variables],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = [line for line in dry.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"make -n {target} printed {lines}"
    return shlex.split(lines[0])


def run_make(cwd: Path, target: str, *variables: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run what `make <target>` runs, in `cwd` (its relative outputs/ land there), stdout + stderr merged."""
    return subprocess.run(
        make_command(target, *variables), cwd=cwd, env=job_env(), timeout=timeout,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def run_make_alone(cwd: Path, target: str, *variables: str) -> tuple[subprocess.CompletedProcess, Alone]:
    """run_make with a temp folder and a /dev/shm of its own (tests/leftovers.py run_alone): what `make
    <target>` printed and what it left. The temp folder is short (`make bench`'s SeaweedFS listens on a Unix
    socket in it)."""
    with short_folder("sdm-") as base:
        return run_alone(
            make_command(target, *variables), base, job_env(), cwd=cwd, timeout=900, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip


class DemoRun:
    """`make demo` run once in a fresh folder: the folder, the demo's output root, what it printed and what it
    left in its temp folder and /dev/shm (tests/leftovers.py run_alone)."""

    def __init__(self, cwd: Path, output: str, left: Alone):
        self.cwd = cwd
        self.root = cwd / "outputs" / "demo"
        self.output = output
        self.left = left


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The real `make demo` command (the full 600-step tiny run, 2-3 CPU minutes alone) in a fresh folder,
    with a temp folder and a /dev/shm of its own, shared by the learning test, the newcomer-path test and
    the leftover test (tests/train/tools/test_nothing_left_behind.py)."""
    cwd = tmp_path_factory.mktemp("newcomer")
    result, left = run_make_alone(cwd, "demo")
    assert result.returncode == 0, result.stdout[-3000:]
    return DemoRun(cwd, result.stdout, left)


# `make bench` with every section on, each cut to seconds where its counters allow: 6 timed trainer batches
# (the tiny recipe flushes its log at 5) and 2 flow batches over 8 rows (an epoch ends among them), 12 S3
# batches with a checkpoint every 4, the 2-rank job's SD2-shaped checkpoint at one repeat. Every section
# that starts processes or servers runs: the loader (Streaming), the trainer (Composer), buckets, encode
# (decode workers), S3 (SeaweedFS) and the 2-rank gloo job (FSDP). The recipe as run and the host twin run
# Composer in the bench's process again, as the trainer section does, so they are off;
# tests/train/bench/test_bench.py runs them in process.
BENCH_ALONE = (
    "step.resolutions=[64] step.repeats=1 step.warmup=0 loader.rows=8 loader.passes=1 trainer.batches=6 "
    "trainer.warmup=1 trainer.flow_batches=2 trainer.as_recipe=false trainer.host_twin=false "
    "anatomy.enabled=false buckets.repeats=1 buckets.bucket_step=16 buckets.loader_rows=4 encode.samples=8 "
    "encode.repeats=1 encode.vae_resolutions=[] scale.ckpt_repeats=1"
)


class BenchRun:
    """`make bench` run once in a fresh folder: what it printed, its JSON, and what it left behind."""

    def __init__(self, output: str, result: dict[str, Any], left: Alone):
        self.output = output
        self.result = result
        self.left = left


@pytest.fixture(scope="session")
def bench_alone(tmp_path_factory: pytest.TempPathFactory) -> BenchRun:
    """The real `make bench` command (BENCH_ALONE's knobs) in a fresh folder with a temp folder and a
    /dev/shm of its own: the newcomer's `make bench`, the scale counters
    (tests/train/bench/test_bench_scale_counters.py) and the leftover test read this one run."""
    cwd = tmp_path_factory.mktemp("bench-alone")
    result, left = run_make_alone(cwd, "bench", f"ARGS={BENCH_ALONE}")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    return BenchRun(result.stdout, json.loads((cwd / "outputs" / "bench" / "bench.json").read_text()), left)


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A 1-rank gloo default process group for in-process FSDP. An earlier in-process Composer run keeps
    its default group for the life of the pytest process: reuse it then (it is one gloo rank too) rather than
    fail on a second init, and leave it as found."""
    import torch.distributed as dist

    if dist.is_initialized():
        assert dist.get_world_size() == 1, "an in-process test left a multi-rank process group behind"
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg-store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
