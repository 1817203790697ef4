"""Composer's env report (every Trainer's hparams, every checkpoint's metadata) names the CPU in process: the
same name py-cpuinfo finds, without the Python subprocess py-cpuinfo starts on every rank."""

from __future__ import annotations

import platform
from pathlib import Path

import cpuinfo
import pytest
from composer.utils import collect_env

from shared.runtime.device import host_cpu_name
from train.loop.trainer import composer_names_the_cpu_in_process

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
"""


def test_the_model_name_comes_from_proc_cpuinfo(tmp_path: Path) -> None:
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    assert host_cpu_name(tmp_path / "cpuinfo") == "Intel(R) Xeon(R) Platinum 8480+"


def test_without_proc_cpuinfo_the_platform_names_it(tmp_path: Path) -> None:
    assert host_cpu_name(tmp_path / "missing") == (platform.processor() or "CPU")


def test_composers_env_report_names_the_cpu_as_py_cpuinfo_does_without_running_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if Path("/proc/cpuinfo").exists() and platform.machine() in ("x86_64", "AMD64"):
        assert host_cpu_name() == cpuinfo.get_cpu_info()["brand_raw"]  # the name Composer recorded before
    monkeypatch.setattr(collect_env, "get_cpu_model", collect_env.get_cpu_model)  # put back afterwards

    def refuse() -> dict[str, str]:
        raise AssertionError("py-cpuinfo ran (a Python subprocess per rank)")

    monkeypatch.setattr(cpuinfo, "get_cpu_info", refuse)
    composer_names_the_cpu_in_process()
    assert collect_env.get_composer_env_dict()["cpu_model"] == host_cpu_name()
