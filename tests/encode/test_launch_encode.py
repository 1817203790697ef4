"""Launch plans for encode: torchrun ranks, Slurm arrays with a dependent finalize, Kubernetes; and proof
that 1 rank, 2 torchrun ranks and 2 independent array tasks + finalize write the same dataset.

The plan/render code lives in train/launch*.py but imports nothing heavy (never composer), so
`python -m train.launch encode ...` is the encode launcher.
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

from shared.contract import KEY
from train.launch import FINALIZE_DEPENDENT, FINALIZE_IN_BAND, app, describe, plan_encode
from train.launch_plan import LaunchOptions

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
    code, out = cli("encode", str(plain_yaml), "--gpus", "2", "--dry-run", "encoder.batch_size=4")
    assert code == 0, out
    assert "1 node(s) x 2 GPUs (world size 2)" in out
    assert FINALIZE_IN_BAND in out
    assert (
        f"--standalone --nnodes=1 --nproc-per-node=2 -m encode run {plain_yaml} encoder.batch_size=4" in out
    )


def test_slurm_array_then_dependent_finalize(plain_yaml: Path, tmp_path: Path, monkeypatch) -> None:
    calls = fake_sbatch(tmp_path, monkeypatch)
    code, out = cli("encode", str(plain_yaml), "--gpus", "12", "--launcher", "slurm", "encoder.batch_size=4")
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
        "encode", str(plain_yaml), "--gpus", "4", "--launcher", "slurm", "--nodes", "2", "--dry-run"
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
    code, out = cli("encode", *(arg.format(yaml=plain_yaml) for arg in args), "--dry-run")
    assert code == 2, out
    assert message in out


def test_encode_launch_never_imports_composer(plain_yaml: Path) -> None:
    code = (
        "import sys\nfrom train.launch import plan_encode, describe\n"
        "from train.launch_plan import LaunchOptions\n"
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
    argv = [PYTHON, "-m", "train.launch", "encode", str(config), "--gpus", str(gpus)]
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
