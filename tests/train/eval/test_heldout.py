"""The held-out loss (issue 25): logged during training at fixed timesteps and noise, one metrics.jsonl line
per step, reproduced by `train eval` from the checkpoint written at that step, independent of how the
samples are split over ranks and batches."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.config import ConfigError
from shared.contract import LATENT_LOGVAR, LATENT_MEAN, TEXT_EMBEDDING, ContractError
from tests.train.conftest import REPO_ROOT, TINY_RUN_EVAL, TinyRun, stream_overrides, tiny_config
from train.config import EvalConfig, ModelConfig
from train.eval.checkpoint import eval_config, evaluate_checkpoint
from train.eval.cost import num_batches
from train.eval.data import EvalRows, rank_indices
from train.eval.heldout import heldout_sums, loss_metrics, pair_noise, rank_pairs
from train.model.diffusion import Objective

RTOL = 1e-5  # the same pairs in other batch compositions: float rounding of batched convolutions only


def eval_lines(run: TinyRun) -> dict[int, dict[str, float]]:
    lines = [json.loads(line) for line in (run.save / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line for line in lines if "eval/ema/loss" in line}


def test_training_logs_the_eval_on_its_steps_line(tiny_run: TinyRun) -> None:
    lines = [json.loads(line) for line in (tiny_run.save / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 13))  # still one line per step
    logged = eval_lines(tiny_run)
    assert sorted(logged) == [6, 12]
    keys = {"eval/ema/loss", "eval/ema/loss_t100", "eval/ema/loss_t900", "eval/training/loss"}
    assert keys <= set(logged[12]) and "loss" in logged[12]
    for step in (6, 12):  # the overall loss is the mean of the per-timestep means
        per_t = [logged[step][f"eval/ema/loss_t{t}"] for t in (100, 900)]
        assert logged[step]["eval/ema/loss"] == pytest.approx(sum(per_t) / 2, rel=1e-12)
    assert logged[6]["eval/ema/loss"] != logged[12]["eval/ema/loss"]
    assert logged[12]["eval/ema/loss"] != logged[12]["eval/training/loss"]
    assert (tiny_run.save / "loss.png").stat().st_size > 1000  # the run's loss plot, with the eval points


@pytest.mark.parametrize(("step", "name"), [(6, "ep0-ba6-rank0.pt"), (12, "ep1-ba12-rank0.pt")])
def test_train_eval_reproduces_the_logged_loss(tiny_run: TinyRun, step: int, name: str) -> None:
    logged = eval_lines(tiny_run)[step]
    cache = str(tiny_run.save.parent / "cache")
    for weights in ("ema", "training"):
        result = evaluate_checkpoint(str(tiny_run.save / name), weights, cache_dir=cache)
        assert result.step == step and result.weights == weights
        assert set(result.metrics) == {k for k in logged if k.startswith(f"eval/{weights}/")}
        for key, value in result.metrics.items():
            assert value == pytest.approx(logged[key], rel=RTOL), key


def test_train_eval_cli_writes_flat_json(tiny_run: TinyRun, tmp_path) -> None:
    out = tmp_path / "eval.json"
    done = subprocess.run(
        [sys.executable, "-m", "train", "eval", str(tiny_run.save), "--out", str(out),
         "num_samples=4"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert set(metrics) == {"eval/ema/loss", "eval/ema/loss_t100", "eval/ema/loss_t900"}
    assert "eval/ema/loss" in done.stdout and "step 12" in done.stdout


def test_train_eval_refuses_bad_settings(tiny_run: TinyRun) -> None:
    record = tiny_run.checkpoint_state()["callbacks"]["RunRecord"]
    assert eval_config(record, ["num_samples=4"]).num_samples == 4
    with pytest.raises(ConfigError, match="outside"):
        eval_config(record, ["timesteps=[100,1000]"])
    with pytest.raises(ConfigError, match="unknown key"):
        eval_config(record, ["eval.nmu_samples=4"])
    with pytest.raises(ConfigError, match="pass uri="):
        eval_config({**record, "eval": {}}, [])


def test_config_checks_the_eval_section(tiny_dataset: str, tmp_path) -> None:
    with pytest.raises(ConfigError, match="distinct"):
        tiny_config(tiny_dataset, tmp_path / "s", tmp_path / "c", "eval.timesteps=[100,100]")
    with pytest.raises(ConfigError, match=r"eval\.num_samples"):
        tiny_config(tiny_dataset, tmp_path / "s", tmp_path / "c", "eval.num_samples=0")
    with pytest.raises(ConfigError, match=r"eval\.interval"):
        tiny_config(tiny_dataset, tmp_path / "s", tmp_path / "c", "eval.interval=0.5dur")
    with pytest.raises(ConfigError, match=r"is data this run trains on .*would not be held out"):
        tiny_config(tiny_dataset, tmp_path / "s", tmp_path / "c", f"eval.uri={tiny_dataset}/")
    streams = stream_overrides("{uri: s3://b/laion, name: laion}", f"{{uri: {tiny_dataset}, name: mine}}")
    with pytest.raises(ConfigError, match=r"is data this run trains on"):
        tiny_config("", tmp_path / "s", tmp_path / "c", *streams, f"eval.uri={tiny_dataset}")


def other_encoders_copy(dataset: str, out: Path) -> str:
    """`dataset` as if encoded with another VAE (other weights, other scale factor)."""
    shutil.copytree(dataset, out)
    for path in [out / "manifest.json", *out.glob("versions/*/manifest.json")]:
        manifest = json.loads(path.read_text())
        manifest["encoder"]["vae_hash"] = "0" * 64
        manifest["scale_factor"] = 0.18215
        path.write_text(json.dumps(manifest))
    return str(out)


def test_an_eval_set_from_other_encoders_is_refused(tiny_run: TinyRun, tmp_path: Path) -> None:
    """Its held-out loss would score latents the model never trained on (a mix of the two is refused too)."""
    from train.loop.trainer import build_trainer

    other = other_encoders_copy(str(tiny_run.cfg.eval.uri), tmp_path / "other-vae")
    cache = str(tmp_path / "cache")
    with pytest.raises(ContractError, match=r"eval\.uri .* was encoded with scale factor 0\.18215"):
        evaluate_checkpoint(str(tiny_run.save), "ema", [f"uri={other}"], cache_dir=cache)
    cfg = tiny_config(
        tiny_run.cfg.data.uri, tmp_path / "save", tmp_path / "cache", f"eval.uri={other}", *TINY_RUN_EVAL
    )
    with pytest.raises(ContractError, match="encode the held-out set with the training data's encoder"):
        build_trainer(cfg)


def fake_rows(n: int, indices: list[int]) -> EvalRows:
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(n, 4, 8, 8, generator=gen)
    cols = {
        LATENT_MEAN: mean,
        LATENT_LOGVAR: torch.full((n, 4, 8, 8), -4.0),
        TEXT_EMBEDDING: torch.randn(n, 5, 16, generator=gen),
    }
    return EvalRows(indices, {k: v[indices] for k, v in cols.items()}, None)  # type: ignore[arg-type]


def toy_denoise(x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for the U-Net whose output depends on every input."""
    return 0.7 * x + 1e-3 * t[:, None, None, None] + text.mean(dim=(1, 2))[:, None, None, None]


def test_the_loss_is_the_same_on_any_rank_count_and_batch_size() -> None:
    cfg = EvalConfig(uri="x", num_samples=7, timesteps=[10, 500, 990], seed=5)
    objective = Objective(ModelConfig(), 0.18215, torch.zeros(5, 16))

    def on_ranks(world: int, batch: int) -> dict[str, float]:
        total = torch.zeros(2, 3, dtype=torch.float64)
        for rank in range(world):  # the all-reduce, done by hand
            indices = rank_indices(7, rank, world)
            rows = fake_rows(7, indices or [0])
            rows.padding = not indices
            batches = rank_pairs(rows, cfg.timesteps, batch, num_batches(cfg, world, batch))
            assert len(batches) == num_batches(cfg, world, batch)  # every rank the same forwards
            total += heldout_sums(toy_denoise, objective, rows, cfg, batches, torch.device("cpu"))
        assert total[1].tolist() == [7.0, 7.0, 7.0]  # padding pairs weigh nothing
        return loss_metrics(total, cfg.timesteps, "ema")

    one = on_ranks(1, 4)
    for world, batch in ((2, 4), (3, 5), (4, 1), (8, 2)):
        other = on_ranks(world, batch)
        assert other == pytest.approx(one, rel=1e-6)


def test_the_noise_depends_on_seed_sample_and_timestep_only() -> None:
    a = pair_noise(0, 3, 100, (4, 8, 8))
    assert all(torch.equal(x, y) for x, y in zip(a, pair_noise(0, 3, 100, (4, 8, 8)), strict=True))
    for other in (
        pair_noise(1, 3, 100, (4, 8, 8)),
        pair_noise(0, 4, 100, (4, 8, 8)),
        pair_noise(0, 3, 101, (4, 8, 8)),
    ):
        assert not torch.equal(a[1], other[1])


def test_the_cost_is_a_small_share_of_training() -> None:
    from train.eval.cost import forwards_per_eval, overhead

    cfg = EvalConfig(uri="x")  # 2048 samples x 5 timesteps every 5000 batches
    assert forwards_per_eval(cfg, world=8, batch=4) == 2 * (256 * 5) // 4
    for world, per_rank in ((8, 256), (256, 8)):  # SD2's global batch of 2048 on 8 or 256 GPUs
        assert overhead(cfg, world, 4, per_rank, 5000) == pytest.approx(2 * 2048 * 5 / (3 * 2048 * 5000))


def test_the_dry_run_plan_prices_the_eval(tmp_path: Path) -> None:
    """The eval's share of the step budget is in the launch plan (train/eval/cost.py), not only the log."""
    from shared.launch.plan import LaunchOptions
    from train.launch import plan_train

    save = f"save_folder={tmp_path / 'save'}"
    with_eval = plan_train(
        "sd2-base-256", [save, "eval.uri=s3://bucket/coco-val"], LaunchOptions(256, "slurm")
    )
    line = next(line for line in with_eval.cluster if line.startswith("held-out eval:"))
    assert "2048 samples x 5 timesteps every 5000ba" in line and "0.07% of the training compute" in line
    without = plan_train("sd2-base-256", [save], LaunchOptions(256, "slurm"))
    assert not any(line.startswith("held-out eval:") for line in without.cluster)
