"""The resilience settings: checked where declared, carried into the launch (supervisor flags, sbatch lines,
pod grace period) and into the dry-run plan's numbers."""

from __future__ import annotations

import math

import pytest

from shared.config import ConfigError
from shared.launch.plan import LaunchOptions
from tests.train.conftest import tiny_config
from train.launch import plan_train


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("resilience.max_restarts=-1", "resilience.max_restarts must be >= 0"),
        ("resilience.hang_timeout_s=0", "resilience.hang_timeout_s must be > 0"),
        ("resilience.max_wall_time=12hours", "must be a duration such as 3600s, 90m, 11.5h or 2d"),
        ("save_interval_minutes=0", "save_interval_minutes must be > 0"),
    ],
)
def test_bad_resilience_settings_are_refused_naming_the_key(tmp_path, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        tiny_config("data", tmp_path / "save", tmp_path / "cache", override)


def test_max_wall_time_reads_units(tmp_path) -> None:
    cfg = tiny_config("data", tmp_path / "save", tmp_path / "cache", "resilience.max_wall_time=11.5h")
    assert cfg.resilience.max_wall_time_s() == 11.5 * 3600


def test_the_plan_carries_the_settings_into_every_launcher(tmp_path) -> None:
    overrides = [
        f"save_folder={tmp_path}/save", "resilience.max_restarts=5", "resilience.hang_timeout_s=900",
        "resilience.max_requeues=7", "resilience.max_wall_time=2d", "save_interval_minutes=30",
    ]  # fmt: skip
    slurm = plan_train("sd2-base-256", overrides, LaunchOptions(256, "slurm"))
    script = slurm.steps[0].stdin or ""
    lead = slurm.supervision.deadline_lead_s
    assert "-m shared.launch.supervise --max-restarts=5 --hang-timeout-s=900" in script
    assert f"--max-wall-time-s={2 * 86400}" in script
    assert f"#SBATCH --signal=B:USR1@{lead:g}" in script and "#SBATCH --requeue" in script
    assert 'if [ "$SEGMENT" -lt 7 ]' in script
    lines = "\n".join(slurm.cluster)
    assert "interruptions: expect" in lines and "on 256 GPUs" in lines
    assert "lost per interruption" in lines and "or 30 min" in lines
    k8s = plan_train("sd2-base-256", overrides, LaunchOptions(16, "k8s", image="reg/sd:1"))
    k8s_lead = math.ceil(k8s.supervision.deadline_lead_s)
    assert f"terminationGracePeriodSeconds: {max(30, k8s_lead)}" in (k8s.steps[0].stdin or "")
