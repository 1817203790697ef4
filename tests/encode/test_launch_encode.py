"""Launch plans for encode: torchrun ranks, Slurm arrays with a dependent finalize, Kubernetes; and proof
that 1 rank, 2 torchrun ranks and 2 independent array tasks + finalize write the same dataset.

The plan/render code (shared/launch/, encode/launch.py) imports nothing heavy (never composer), so
`python -m encode launch ...` is the encode launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from encode.cli import app
from encode.launch import FINALIZE_DEPENDENT, FINALIZE_IN_BAND, plan_encode
from shared.contract import KEY
from shared.launch.plan import LaunchOptions
from shared.launch.report import describe

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
RUNNER = CliRunner()
ENCODE_TIMEOUT_S = 300
RESOLUTION = 64
SHARDS, PER_SHARD = 3, 8  # 3 partitions: 2 ranks get an uneven share


def dataset_yaml(path: Path, source: str, output: str) -> Path:
    config = {
        "name": "launch-test",
        "preset": "tiny",
        "source": {"uri": source, "format": "webdataset"},
        "filter": {"min_size": RESOLUTION},
        "transform": {"resolutions": [RESOLUTION]},
        "encoder": {"device": "cpu", "batch_size": 8},
        "output": {"uri": output},
        "workers": 0,
        "progress": False,
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def plain_yaml(tmp_path: Path) -> Path:
    return dataset_yaml(tmp_path / "ds.yaml", "s3://bucket/laion/{00000..00009}.tar", "s3://bucket/out")


def cli(*args: str) -> tuple[int, str]:
    result = RUNNER.invoke(app, list(args))
    return result.exit_code, result.output


def fake_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An sbatch on PATH that records args + stdin per call and answers job ids 101, 102, ..."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    script = f"""\
        #!/bin/bash
        n=$(( $(ls "{calls}" | grep -c '\\.args$' || true) + 1 ))
        printf '%s\\n' "$@" > "{calls}/$n.args"
        cat > "{calls}/$n.stdin"
        echo "$((100 + n))"
        """
    (bin_dir / "sbatch").write_text(textwrap.dedent(script))
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


# ------------------------------------------------------------------------------------------ plans
def test_local_plan_runs_torchrun_and_finalizes_in_band(plain_yaml: Path) -> None:
    code, out = cli("launch", str(plain_yaml), "--gpus", "2", "--dry-run", "encoder.batch_size=4")
    assert code == 0, out
    assert "1 node x 2 GPUs (world size 2)" in out
    assert FINALIZE_IN_BAND in out
    assert (
        f"--standalone --nnodes=1 --nproc-per-node=2 -m encode run {plain_yaml} encoder.batch_size=4" in out
    )


def test_slurm_array_then_dependent_finalize(plain_yaml: Path, tmp_path: Path, monkeypatch) -> None:
    calls = fake_sbatch(tmp_path, monkeypatch)
    code, out = cli("launch", str(plain_yaml), "--gpus", "12", "--launcher", "slurm", "encoder.batch_size=4")
    assert code == 0, out
    assert (calls / "1.args").read_text().splitlines() == ["--parsable"]
    assert (calls / "2.args").read_text().splitlines() == [
        "--parsable",
        "--dependency=afterok:101",  # the array's id, as the first sbatch printed it
        "--kill-on-invalid-dep=yes",
    ]
    plan = plan_encode(str(plain_yaml), ["encoder.batch_size=4"], LaunchOptions(12, "slurm"))
    assert (calls / "1.stdin").read_text() == plan.steps[0].stdin
    assert (calls / "2.stdin").read_text() == plan.steps[1].stdin
    assert "Slurm job 101" in out and "Slurm job 102" in out
    array, finalize = plan.steps[0].stdin, plan.steps[1].stdin
    assert array is not None and finalize is not None
    assert "#SBATCH --array=0-11" in array and "#SBATCH --gpus=1" in array
    assert "WORLD_SIZE=12" in array and "unset MASTER_ADDR" in array
    assert f"-m encode run {plain_yaml} encoder.batch_size=4" in array
    assert f"-m encode finalize {plain_yaml} encoder.batch_size=4" in finalize
    assert "--gpus" not in finalize
    for name, script in (("array", array), ("finalize", finalize)):
        path = tmp_path / f"{name}.sbatch"
        path.write_text(script)
        subprocess.run(["bash", "-n", str(path)], check=True)


def test_slurm_dry_run_shows_both_jobs(plain_yaml: Path) -> None:
    code, out = cli(
        "launch", str(plain_yaml), "--gpus", "4", "--launcher", "slurm", "--nodes", "2", "--dry-run"
    )
    assert code == 0, out
    assert "4 array tasks x 1 GPU" in out
    assert FINALIZE_DEPENDENT in out
    assert "$ sbatch --parsable '--dependency=afterok:<array-job-id>'" in out
    assert "NODES is ignored" in out


def test_k8s_manifest_runs_encode_ranks(plain_yaml: Path) -> None:
    options = LaunchOptions(16, "k8s", image="reg/sd:1")
    plan = plan_encode(str(plain_yaml), [], options)
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(plan.steps[0].stdin or "") if doc}
    spec = docs["Job"]["spec"]
    assert (spec["completions"], spec["parallelism"]) == (2, 2)
    [container] = spec["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["command"][-4:] == ["-m", "encode", "run", str(plain_yaml)]
    assert plan.finalize == FINALIZE_IN_BAND
    local_yaml = dataset_yaml(plain_yaml.parent / "local.yaml", "/data/in", "/data/out")
    local = plan_encode(str(local_yaml), [], options)
    assert any("local paths" in note for note in local.notes)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no-such-dataset"], "no config named 'no-such-dataset'"),
        (["{yaml}", "transform.resolutions=[65]"], "not a multiple of"),
        (
            ["{yaml}", "--gpus", "12", "--launcher", "k8s", "--image", "x"],
            "not a multiple of 8 GPUs per node",
        ),
    ],
)
def test_bad_requests_stop_before_launching(plain_yaml: Path, args: list[str], message: str) -> None:
    code, out = cli("launch", *(arg.format(yaml=plain_yaml) for arg in args), "--dry-run")
    assert code == 2, out
    assert message in out


def test_encode_launch_never_imports_composer(plain_yaml: Path) -> None:
    code = (
        "import sys\nfrom encode.launch import plan_encode\nfrom shared.launch.report import describe\n"
        "from shared.launch.plan import LaunchOptions\n"
        f"describe(plan_encode({str(plain_yaml)!r}, [], LaunchOptions(2, 'local')))\n"
        f"describe(plan_encode({str(plain_yaml)!r}, [], LaunchOptions(16, 'slurm')))\n"
        "assert 'composer' not in sys.modules"
    )
    subprocess.run([PYTHON, "-c", code], cwd=REPO, check=True, timeout=60)


# ------------------------------------------------------------------------------------------ real ranks
def dataset_rows(root: Path) -> dict[str, dict[str, bytes]]:
    """Every sample of one resolution as {key: {column: bytes}}."""
    from streaming import LocalDataset

    dataset = LocalDataset(str(root / str(RESOLUTION)))
    rows = {}
    for i in range(len(dataset)):
        sample = dataset[i]
        rows[sample[KEY]] = {
            k: v.tobytes() if hasattr(v, "tobytes") else str(v).encode() for k, v in sample.items()
        }
    return rows


def encode_env() -> dict[str, str]:
    # One thread per process: CPU kernels then give identical bytes whatever the number of ranks.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def launch_encode(config: Path, gpus: int) -> None:
    argv = [PYTHON, "-m", "encode", "launch", str(config), "--gpus", str(gpus)]
    result = subprocess.run(argv, env=encode_env(), capture_output=True, text=True, timeout=ENCODE_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def source_and_one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, bytes]]]:
    """The sample webdataset and what one rank makes of it (the reference for the others)."""
    from encode.sample_data import build_webdataset

    root = tmp_path_factory.mktemp("encode-launch")
    build_webdataset(root / "src", shards=SHARDS, per_shard=PER_SHARD)
    launch_encode(dataset_yaml(root / "one.yaml", str(root / "src"), str(root / "one")), gpus=1)
    rows = dataset_rows(root / "one")
    assert len(rows) > SHARDS  # every partition kept some samples
    return root / "src", rows


@pytest.mark.dist
@pytest.mark.slow
def test_two_torchrun_ranks_write_the_same_dataset_as_one(source_and_one_rank, tmp_path: Path) -> None:
    source, one_rank = source_and_one_rank
    launch_encode(dataset_yaml(tmp_path / "two.yaml", str(source), str(tmp_path / "two")), gpus=2)
    assert (tmp_path / "two" / "manifest.json").exists()  # rank 0 finalized after the barrier
    assert dataset_rows(tmp_path / "two") == one_rank


def run_array_task(script: str, task: int, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """One Slurm array task as the scheduler starts it: its index in SLURM_ARRAY_TASK_ID."""
    task_env = {**env, "SLURM_ARRAY_TASK_ID": str(task)}
    return subprocess.Popen(
        ["bash", "-c", script],
        env=task_env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_slurm_array_tasks_then_finalize_write_the_same_dataset(source_and_one_rank, tmp_path: Path) -> None:
    """Run the rendered array script as two independent tasks, then the rendered finalize script."""
    source, one_rank = source_and_one_rank
    config = dataset_yaml(tmp_path / "array.yaml", str(source), str(tmp_path / "array"))
    plan = plan_encode(str(config), [], LaunchOptions(2, "slurm"))
    array, finalize = (step.stdin or "" for step in plan.steps)
    env = {**encode_env(), "MASTER_ADDR": "leaked-from-the-login-node"}  # the script must drop it
    tasks = [run_array_task(array, task, env, tmp_path) for task in (0, 1)]
    for task in tasks:
        output, _ = task.communicate(timeout=ENCODE_TIMEOUT_S)
        assert task.returncode == 0, output[-3000:]
        assert "published" not in output  # separate tasks never finalize themselves
    assert not (tmp_path / "array" / "manifest.json").exists()
    result = subprocess.run(
        ["bash", "-c", finalize],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=ENCODE_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert dataset_rows(tmp_path / "array") == one_rank


def test_describe_names_the_finalize_step(plain_yaml: Path) -> None:
    text = describe(plan_encode(str(plain_yaml), [], LaunchOptions(16, "slurm")))
    assert "step 2: the finalize job" in text


# ------------------------------------------------------------------------------------------ fits the cluster
def _array_header(plan) -> str:
    return (plan.steps[0].stdin or "").split("set -euo pipefail")[0]


def test_array_tasks_ask_for_cpus_and_memory_from_the_workers(plain_yaml: Path) -> None:
    """workers + 1 CPUs and 8 GiB + 2 GiB per worker per task, never a hard-coded 8 CPUs."""
    plan = plan_encode(str(plain_yaml), ["workers=3"], LaunchOptions(4, "slurm"))
    header = _array_header(plan)
    assert "#SBATCH --cpus-per-task=4\n" in header and "#SBATCH --mem=14G\n" in header
    finalize = (plan.steps[1].stdin or "").split("set -euo pipefail")[0]
    assert "#SBATCH --mem=16G" in finalize  # it loads the encoders as a rank does
    flags = LaunchOptions(4, "slurm", cpus_per_rank=2, mem_per_rank_gb=6)
    header = _array_header(plan_encode(str(plain_yaml), ["workers=3"], flags))
    assert "#SBATCH --cpus-per-task=2\n" in header and "#SBATCH --mem=6G\n" in header
    assert "4 CPUs, 14 GiB memory" in describe(plan)


def test_k8s_encode_pods_request_their_ranks_resources(plain_yaml: Path) -> None:
    plan = plan_encode(str(plain_yaml), ["workers=2"], LaunchOptions(16, "k8s", image="reg/sd:1"))
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(plan.steps[0].stdin or "") if doc}
    [container] = docs["Job"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {"cpu": str(3 * 8), "memory": f"{12 * 8}Gi"}


def make_encode(config: Path, launch_args: str) -> subprocess.CompletedProcess:
    """The Makefile path end to end (`-o` the install stamp: never reinstall from a test)."""
    argv = ["make", "--no-print-directory", "-C", str(REPO), "-o", ".venv/.installed-stamp", "encode"]
    argv += [f"DATASET={config}", "GPUS=4", "LAUNCHER=slurm", f"LAUNCH_ARGS={launch_args}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def test_make_launch_args_pass_any_sbatch_option(plain_yaml: Path, tmp_path: Path, monkeypatch) -> None:
    calls = fake_sbatch(tmp_path, monkeypatch)
    args = "--partition gpu --sbatch-option qos=high --sbatch-option requeue --cpus-per-rank 5"
    result = make_encode(plain_yaml, args)
    assert result.returncode == 0, result.stdout + result.stderr
    for n in (1, 2):  # the array and the finalize job
        header = (calls / f"{n}.stdin").read_text().split("set -euo pipefail")[0]
        assert "#SBATCH --partition=gpu\n#SBATCH --qos=high\n#SBATCH --requeue\n" in header
    assert "#SBATCH --cpus-per-task=5" in (calls / "1.stdin").read_text()


def test_make_launch_args_cannot_inject_lines(plain_yaml: Path, tmp_path: Path, monkeypatch) -> None:
    calls = fake_sbatch(tmp_path, monkeypatch)
    # The newline arrives through the shell make runs, from a variable (make itself splits recipe lines).
    monkeypatch.setenv("EVIL_PARTITION", "gpu\n#SBATCH --qos=evil")
    result = make_encode(plain_yaml, '--partition="$$EVIL_PARTITION"')
    assert result.returncode != 0
    assert "--partition" in result.stderr and "control character" in result.stderr
    assert not list(calls.iterdir())
