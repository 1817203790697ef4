"""Launch plans for train: layout and batch derivation, rendered specs, submission, errors, real torchrun.

Cluster binaries that cannot exist here (sbatch, kubectl, srun, scontrol) are small shell scripts on PATH
that record what they receive; torchrun and torch.distributed (gloo) are real.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from shared.batching import BatchingError, derive_batching
from shared.launch import plan as launch_plan
from shared.launch import steps
from shared.launch.plan import (
    GPU_DRIVER_PATHS,
    LaunchError,
    LaunchOptions,
    LaunchPlan,
    Topology,
    derive_topology,
    job_name,
    local_torchrun,
)
from shared.launch.report import summarize
from shared.launch.specs import (
    ENV_FILE,
    SLURM_NODES,
    TEMPLATES_DIR,
    SbatchHeader,
    SlurmSite,
    load_env_vars,
    node_resources,
    render_env_exports,
    render_sbatch,
    render_template,
)
from shared.launch.steps import inside_single_quotes, torchrun_args
from shared.runtime.exits import torchrun_argv
from tests.train.conftest import make_command
from train.cli import app
from train.launch import launch_command, load_train_config, plan_train

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
RUNNER = CliRunner()
PROBE_TIMEOUT_S = 120
# A probe "job": joins the process group when torchrun set one up, checks an all_reduce, records its env.
PROBE_SOURCE = """
import json, os, sys
out = os.environ["PROBE_OUT"]
record = {k: os.environ.get(k) for k in
          ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "GROUP_RANK",
           "TORCHELASTIC_RUN_ID")}
record["argv"] = sys.argv[1:]
if os.environ.get("MASTER_ADDR"):
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    record["all_reduce"] = total.item()
    dist.destroy_process_group()
with open(os.path.join(out, f"rank{record['RANK']}.json"), "w") as handle:
    json.dump(record, handle)
"""


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture
def train_yaml(tmp_path: Path) -> Path:
    """A train config with the SD2 batch (2048 global, microbatch 4)."""
    path = tmp_path / "sd2-test.yaml"
    config = {
        "name": "sd2-test",
        "global_batch_size": 2048,
        "device_microbatch_size": 4,
        "save_folder": "s3://bucket/ckpt",
        "data": {"uri": "s3://bucket/laion"},
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], Path]:
    """Make a fake cluster binary on PATH that saves each call's args and stdin and prints `reply`."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def make(name: str, reply: str) -> Path:
        script = f"""\
            #!/bin/bash
            set -e
            n=$(( $(ls "{calls}" | grep -c '^{name}-.*\\.args$' || true) + 1 ))
            printf '%s\\n' "$@" > "{calls}/{name}-$n.args"
            cat > "{calls}/{name}-$n.stdin"
            echo "{reply}"
            """
        path = bin_dir / name
        path.write_text(textwrap.dedent(script))
        path.chmod(0o755)
        return calls

    return make


def recorded(calls: Path, name: str) -> list[tuple[list[str], str]]:
    """(args, stdin) of every recorded call of a fake binary, in call order."""
    out = []
    for n in range(1, 100):
        args = calls / f"{name}-{n}.args"
        if not args.exists():
            break
        out.append((args.read_text().splitlines(), (calls / f"{name}-{n}.stdin").read_text()))
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_probe(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The probe module and the environment that lets torchrun's ranks import it and write results."""
    (tmp_path / "launch_probe.py").write_text(PROBE_SOURCE)
    out = tmp_path / "probe-out"
    out.mkdir()
    pythonpath = os.pathsep.join([str(tmp_path), str(REPO)])
    return out, {**os.environ, "PYTHONPATH": pythonpath, "PROBE_OUT": str(out), "OMP_NUM_THREADS": "1"}


def probe_records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def cli(*args: str) -> tuple[int, str]:
    result = RUNNER.invoke(app, list(args))
    return result.exit_code, result.output


# ------------------------------------------------------------------------------------------ topology
@pytest.mark.parametrize(
    ("gpus", "nodes", "per_node", "expected"),
    [
        (256, None, None, (32, 8)),
        (4, None, None, (1, 4)),
        (8, None, None, (1, 8)),
        (16, 4, None, (4, 4)),
        (16, None, 4, (4, 4)),
        (2, 2, None, (2, 1)),
        (12, 3, 4, (3, 4)),
    ],
)
def test_topology_splits_gpus_over_nodes(gpus, nodes, per_node, expected) -> None:
    topo = derive_topology(gpus, nodes, per_node)
    assert (topo.nodes, topo.gpus_per_node) == expected
    assert topo.world_size == gpus


@pytest.mark.parametrize(
    ("gpus", "nodes", "per_node", "fix"),
    [
        (12, None, None, "use GPUS=8 or 16"),
        (10, 4, None, "does not split evenly over NODES=4"),
        (16, 2, 4, "use GPUS=8"),
        (0, None, None, "must be >= 1"),
    ],
)
def test_impossible_topology_names_the_fix(gpus, nodes, per_node, fix) -> None:
    with pytest.raises(LaunchError, match=re.escape(fix)):
        derive_topology(gpus, nodes, per_node)


def test_job_names_are_dns_labels() -> None:
    assert job_name("train", "sd2-base-256") == "sd-train-sd2-base-256"
    assert job_name("train", "/x/My_Config.yaml") == "sd-train-my-config"
    assert len(job_name("encode", "x" * 200)) <= 50


# ------------------------------------------------------------------------------------------ plans / dry run
def test_dry_run_prints_layout_batching_command_and_estimate(train_yaml: Path) -> None:
    code, out = cli(
        "launch", "--config", str(train_yaml), "--gpus", "256", "--launcher", "slurm", "--dry-run"
    )
    assert code == 0, out
    assert "32 nodes x 8 GPUs (world size 256)" in out
    assert "global 2048 = 256 ranks x 8 per rank; microbatch 4 x 2 accumulation steps" in out
    assert f"python -m train fit {train_yaml}" in out
    assert "$ sbatch --parsable < sd-train-sd2-test.sbatch" in out
    assert "#SBATCH --nodes=32" in out  # the whole rendered script is shown
    # max_duration 1ep: the run's samples depend on the dataset, so only the reference is priced
    assert "estimate         this run: 1ep of the sd2-base preset at 256 px; no time or cost" in out
    assert re.search(
        r"reference .*not this run: the full SD2-base schedule.*256 x A100-40GB: [\d.]+ days", out
    )


def test_dry_run_prices_the_run_being_launched_apart_from_the_reference(train_yaml: Path) -> None:
    """1000 batches of 2048 on 256 GPUs is a fraction of the published schedule, and says so."""
    plan = plan_train(str(train_yaml), ["max_duration=1000ba"], LaunchOptions(256, "slurm"))
    assert plan.estimate is not None and plan.estimate.startswith(
        "this run: 1000ba = 2,048,000 samples of the sd2-base preset at 256 px: 256 x A100-40GB: "
    )
    hours = [float(re.search(r"([\d,.]+) GPU-hours", line).group(1).replace(",", "")) for line in
             (plan.estimate, plan.reference[0])]  # fmt: skip
    assert 0 < hours[0] < hours[1] / 100  # 2 M of the schedule's 2.9 B samples
    assert " min, " in plan.estimate  # a short run reads in minutes, not as 0.00 days


def test_dry_run_says_when_the_host_caps_the_rate_it_priced(tmp_path: Path) -> None:
    """sd2-base-256 on 256 GPUs runs 8 images a microbatch under per-block FSDP: the rate the estimate
    prices needs less time a microbatch than the host's work a step took on an H200 (issue 30)."""
    save = f"save_folder={tmp_path}"
    plan = plan_train("sd2-base-256", [save], LaunchOptions(256, "slurm"))
    (note,) = [n for n in plan.notes if "under per-block FSDP" in n]
    assert note.startswith("8 images per GPU a microbatch under per-block FSDP: the estimate's ")
    assert "expect at most 29.1 img/s per GPU" in note and "throughput_from=outputs/bench/bench.json" in note
    # the same global batch on 16 GPUs at 128 each, and DDP (not measured there), get no such note
    for gpus, extra in ((16, ["device_microbatch_size=128"]), (256, ["fsdp=false"])):
        plan = plan_train("sd2-base-256", [save, *extra], LaunchOptions(gpus, "slurm"))
        assert not [n for n in plan.notes if "under per-block FSDP" in n]


def test_tiny_dry_run_shows_tiny_numbers_and_sets_sd2_numbers_apart(tmp_path: Path) -> None:
    """`make train GPUS=2 DRY_RUN=1` after the demo: tiny memory and checkpoint; SD2 figures as reference."""
    out = summarize(plan_train("tiny", [f"save_folder={tmp_path}"], LaunchOptions(2, "local")))
    assert "1 CPU, 4 GiB memory" in out and "checkpoint 0.01 GB" in out
    assert "this run: 600ba = 19,200 samples of the tiny preset at 64 px; no time or cost" in out
    references = [line for line in out.splitlines() if "reference" in line]
    assert len(references) == 2 and all("not this run:" in line for line in references)
    assert not any("days" in line or "$" in line for line in out.splitlines() if "reference" not in line)


def test_launch_command_registers_on_the_train_cli(train_yaml: Path) -> None:
    """As train/cli.py registers it: `python -m train launch ...`."""
    train_cli = typer.Typer()
    train_cli.command("launch")(launch_command)
    train_cli.command("fit")(lambda: None)
    args = ["launch", "--config", str(train_yaml), "--gpus", "16", "--launcher", "slurm", "--dry-run"]
    args.append("seed=3")
    result = RUNNER.invoke(train_cli, args)
    assert result.exit_code == 0, result.output
    assert "2 nodes x 8 GPUs" in result.output and "seed=3" in result.output


def test_dry_run_launches_nothing(train_yaml: Path, fake_bin) -> None:
    calls = fake_bin("sbatch", "1")
    code, out = cli("launch", "--config", str(train_yaml), "--gpus", "16", "--launcher", "slurm", "--dry-run")
    assert code == 0, out
    assert recorded(calls, "sbatch") == []


def test_overrides_reach_the_batch_split_and_every_rank(train_yaml: Path) -> None:
    plan = plan_train(
        str(train_yaml), ["global_batch_size=64", "device_microbatch_size=2"], LaunchOptions(16, "slurm")
    )
    assert plan.batching is not None
    assert (plan.batching.per_rank_batch, plan.batching.grad_accum) == (4, 2)
    assert plan.program[-2:] == ("global_batch_size=64", "device_microbatch_size=2")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "3", "--gpus-per-node", "3", "--launcher", "slurm"], "not divisible by the world size 3"),
        (["--gpus", "512", "--launcher", "slurm", "device_microbatch_size=3"], "device_microbatch_size=3"),
        (["--gpus", "12", "--launcher", "slurm"], "not a multiple of 8 GPUs per node"),
        (["--gpus", "16", "--launcher", "k8s"], "needs a container image"),
        (["--gpus", "16", "--launcher", "slurm", "--node-rank", "1"], "--node-rank / --master-addr are for"),
        (["--gpus", "16"], "2 nodes do not fit on this machine: use LAUNCHER=slurm"),
        (["--gpus", "4096", "--gpus-per-node", "4096"], "use GPUS="),
        (["--gpus", "8", "--launcher", "slurm", "--name", "Bad_Name"], "pass --name my-run"),
        (["--gpus", "8", "--launcher", "slurm", "no_such_key=1"], "command line: unknown key no_such_key"),
        (["--gpus", "8", "--gpu-type", "H100-80GB"], "unknown GPU type 'H100-80GB'; use one of A100-40GB"),
    ],
)
def test_impossible_requests_stop_with_the_fix(train_yaml: Path, args: list[str], message: str) -> None:
    code, out = cli("launch", "--config", str(train_yaml), *args)
    assert code == 2, out
    assert message in out


def test_unknown_config_name_lists_the_known_ones() -> None:
    code, out = cli("launch", "--config", "no-such-config", "--dry-run")
    assert code == 2
    assert "no config named 'no-such-config'" in out


def test_batching_errors_are_the_shared_ones(train_yaml: Path) -> None:
    """A batch that does not split refuses the plan (a dry run still prints it) with the shared message."""
    plan = plan_train(str(train_yaml), [], LaunchOptions(3, "slurm", gpus_per_node=3))
    with pytest.raises(BatchingError, match="global_batch_size=2048 is not divisible by the world size 3"):
        derive_batching(2048, 3, 8)
    assert plan.refusal is not None and "global_batch_size=2048 is not divisible by the world size 3" in (
        plan.refusal
    )


def test_missing_sbatch_and_kubectl_name_the_fix(train_yaml: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    code, out = cli("launch", "--config", str(train_yaml), "--gpus", "16", "--launcher", "slurm")
    assert code == 2
    assert "`sbatch` not found on PATH" in out and "--dry-run" in out
    code, out = cli(
        "launch", "--config", str(train_yaml), "--gpus", "16", "--launcher", "k8s", "--image", "x"
    )
    assert code == 2
    assert "`kubectl` not found on PATH" in out and "kubectl config use-context" in out


def test_missing_torchrun_names_the_fix(tmp_path: Path, monkeypatch) -> None:
    # An interpreter with no torchrun beside it, and nothing on PATH.
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match=r"torchrun not found .* run `make install`"):
        local_torchrun()


def test_planning_never_imports_composer_or_torch(train_yaml: Path) -> None:
    """Nor does a local launch's plan on a machine without a GPU driver (the launcher stays light: it
    counts GPUs with torch only where there can be some)."""
    local = f"plan_train({str(train_yaml)!r}, [], LaunchOptions(2, 'local'))\n"
    code = (
        "import sys; from train.launch import plan_train; from shared.launch.plan import LaunchOptions\n"
        f"plan_train({str(train_yaml)!r}, [], LaunchOptions(16, 'slurm'))\n"
        f"{'' if any(path.exists() for path in GPU_DRIVER_PATHS) else local}"
        "heavy = sorted(m for m in ('composer', 'torch', 'diffusers') if m in sys.modules)\n"
        "assert not heavy, heavy"
    )
    subprocess.run([PYTHON, "-c", code], cwd=REPO, check=True, timeout=60)


def test_no_gpu_driver_means_no_gpus_without_asking_torch(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(launch_plan, "GPU_DRIVER_PATHS", (tmp_path / "no-driver",))
    monkeypatch.setitem(sys.modules, "torch", None)  # an `import torch` now raises ImportError
    assert launch_plan.local_gpu_count() == 0


# ------------------------------------------------------------------------------------------ Slurm
def test_slurm_submits_exactly_the_rendered_script(train_yaml: Path, fake_bin) -> None:
    calls = fake_bin("sbatch", "4242;cluster-a")
    args = [
        "launch",
        "--config",
        str(train_yaml),
        "--gpus",
        "16",
        "--launcher",
        "slurm",
        "--partition",
        "gpu",
    ]
    code, out = cli(*args, "max_duration=10ba")
    assert code == 0, out
    plan = plan_train(str(train_yaml), ["max_duration=10ba"], LaunchOptions(16, "slurm", partition="gpu"))
    [(sbatch_args, script)] = recorded(calls, "sbatch")
    assert sbatch_args == ["--parsable"]
    assert script == plan.steps[0].stdin
    assert "submitted the sbatch script: Slurm job 4242" in out
    assert "squeue -j 4242" in out


def test_slurm_script_is_valid_bash_with_the_rendezvous_and_knobs(train_yaml: Path, tmp_path: Path) -> None:
    options = LaunchOptions(32, "slurm", partition="gpu", account="ml", time_limit="1-00:00:00", efa=True)
    script = plan_train(str(train_yaml), ["data.uri=s3://b/it's here"], options).steps[0].stdin
    assert script is not None
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    for line in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=gpu", "--account=ml"):
        assert f"#SBATCH {line}" in script
    assert 'NODE_HOSTS="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"' in script
    assert 'export NODE_RANK="$SLURM_NODEID"' in script
    for knob in (
        "NCCL_SOCKET_IFNAME",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "FI_PROVIDER",
        "FI_EFA_USE_DEVICE_RDMA",
    ):
        assert re.search(rf"^# .+\nexport {knob}=", script, re.MULTILINE), knob  # each one documented
    assert "S3_ENDPOINT_URL" in script and "AWS_SECRET_ACCESS_KEY" in script
    assert "{{" not in script


def test_efa_knobs_only_when_asked(train_yaml: Path) -> None:
    plain = plan_train(str(train_yaml), [], LaunchOptions(16, "slurm")).steps[0].stdin
    assert plain is not None and "FI_PROVIDER" not in plain


@pytest.mark.dist
def test_rendered_slurm_script_rendezvouses_two_nodes(tmp_path: Path) -> None:
    """Run the sbatch body for real: fake srun starts one task per "node" on localhost, torchrun is real."""
    out, env = write_probe(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A long host list: reading only its first line through a pipe would SIGPIPE scontrol under pipefail.
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\nseq -f 'node%g' 2 20000\n")
    srun = """\
        #!/bin/bash
        # one task per node, concurrently, each with its SLURM_NODEID (like srun --ntasks-per-node=1)
        while [[ "$1" == --* ]]; do shift; done
        pids=()
        for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
        rc=0
        for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
        exit $rc
        """
    (bin_dir / "srun").write_text(textwrap.dedent(srun))
    for name in ("scontrol", "srun"):
        (bin_dir / name).chmod(0o755)
    topo = Topology(nodes=2, gpus_per_node=1)
    flags = torchrun_args(topo, "$MASTER_ADDR", "$MASTER_PORT", "$RDZV_ID", 0)
    values = {
        "nodes": 2,
        "layout": "2 nodes x 1 GPU",
        "master_port": free_port(),
        "torchrun": local_torchrun(),
        "torchrun_flags": inside_single_quotes(flags),
        "program": "launch_probe --flag 'a b'",
        "python": sys.executable,
        "supervise_flags": "--max-restarts=0 --elastic",
        "lead_s": "60",
        "max_requeues": 0,
    }
    env_block = render_env_exports(load_env_vars(efa=False))
    header = SbatchHeader("probe", "probe", node_resources(topo), SlurmSite(), env_block, str(tmp_path))
    script = render_sbatch(SLURM_NODES, header, values)
    slurm = {
        "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_CPUS_ON_NODE": "2", "SLURM_JOB_ID": "7",
    }  # fmt: skip
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", **slurm)
    result = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    records = probe_records(out)
    # The c10d rendezvous numbers the nodes (GROUP_RANK), in whichever order they arrive.
    assert [(r["RANK"], r["GROUP_RANK"], r["WORLD_SIZE"]) for r in records] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert sorted(r["NODE_RANK"] for r in records) == ["0", "1"]  # the Slurm node ids, one per node
    assert all(r["all_reduce"] == 3.0 and r["TORCHELASTIC_RUN_ID"] == "probe-7-0" for r in records)
    assert records[0]["argv"] == ["--flag", "a b"]


# srun as the Slurm docs describe it: one task per node; a task exiting non-zero ends the step
# (--kill-on-bad-exit: SIGKILL to every other task); srun's code is the highest exit code, or 128 + the
# signal of a task that was killed.
KILL_ON_BAD_EXIT_SRUN = """\
#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i setsid "$@" & pids+=($!); done
rc=0
while ((${#pids[@]})); do
  for i in "${!pids[@]}"; do
    pid=${pids[$i]}
    kill -0 "$pid" 2>/dev/null && continue
    wait "$pid"; code=$?
    unset "pids[$i]"
    ((code > rc)) && rc=$code
    if ((code != 0)); then for other in "${pids[@]}"; do kill -9 -- "-$other" 2>/dev/null; done; fi
  done
  sleep 0.05
done
exit $rc
"""
# torchrun's stand-in: the ranks recorded a resumable stop (train/resilience/exits.py); node 1 takes longer.
RESUMABLE_TORCHRUN = """\
#!/bin/bash
printf '{"state": "resumable", "batch": 3, "message": "stopped at batch 3"}' > "$SD_CONTROL_DIR/exit.json"
sleep $((SLURM_NODEID * 3))
echo "node $SLURM_NODEID saved" >> "$SAVED"
exit 1
"""


def stubbed_nodes_job(tmp_path: Path, srun: str, torchrun: str) -> tuple[str, dict[str, str]]:
    """The two-node sbatch script (slurm-nodes.sh) and an environment with stub `srun`, `scontrol` (which
    records its calls in $CALLS) and torchrun: the script's own logic, run by bash without Slurm."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = (
        '#!/bin/bash\necho "$*" >> "$CALLS"\n[ "$1 $2" = "show hostnames" ] && echo 127.0.0.1\nexit 0\n'
    )
    for name, body in (("srun", srun), ("scontrol", scontrol), ("fake-torchrun", torchrun)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    values = {
        "nodes": 2, "layout": "2 nodes x 1 GPU", "master_port": free_port(),
        "torchrun": str(bin_dir / "fake-torchrun"), "torchrun_flags": "", "program": "train fit tiny",
        "python": sys.executable, "supervise_flags": "--max-restarts=0 --elastic --hang-timeout-s=60",
        "lead_s": "60", "max_requeues": 3,
    }  # fmt: skip
    env_block = render_env_exports(load_env_vars(efa=False))
    topo = Topology(nodes=2, gpus_per_node=1)
    header = SbatchHeader("stop", "stop", node_resources(topo), SlurmSite(), env_block, str(tmp_path))
    env = {
        **os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO),
        "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_CPUS_ON_NODE": "2", "SLURM_JOB_ID": "77",
        "CALLS": str(tmp_path / "calls"), "SAVED": str(tmp_path / "saved"), "TMPDIR": str(tmp_path),
    }  # fmt: skip
    return render_sbatch(SLURM_NODES, header, values), env


def run_batch_script(script: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
    )


def test_a_stop_on_several_nodes_requeues_under_srun_kill_on_bad_exit(tmp_path: Path) -> None:
    """Every node saves and stops at the same step, each in its own time: the first node's exit must not
    end the others (srun kills the step when a task exits non-zero) and the job requeues itself."""
    done = run_batch_script(*stubbed_nodes_job(tmp_path, KILL_ON_BAD_EXIT_SRUN, RESUMABLE_TORCHRUN), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted((tmp_path / "saved").read_text().splitlines()) == ["node 0 saved", "node 1 saved"]
    assert "requeue 77" in (tmp_path / "calls").read_text(), done.stdout + done.stderr
    assert "requeueing job 77 as segment 1" in done.stdout
    assert not list(tmp_path.glob(".slurm-stopped-*")), "the nodes' marks are removed"


# srun whose nodes have saved and stopped (their marks written) as Slurm's USR1 reaches the batch shell:
# srun forwards it (here: ignores it) and exits 0 at that instant.
SRUN_EXITING_AS_THE_SIGNAL_ARRIVES = """\
#!/bin/bash
trap '' USR1
mkdir -p "$STOPPED" && touch "$STOPPED/node-0" "$STOPPED/node-1"
kill -USR1 "$PPID"
exit 0
"""
RACE_TRIES = 12  # the old loop lost srun's status in about 1 run of 3 of this race (15 of 40, bash 5.2)


def test_a_stop_requeues_when_the_signal_arrives_as_srun_exits(tmp_path: Path) -> None:
    """The batch shell's `wait` for srun, cut short by the trapped signal as srun exits, returned 138
    (128 + USR1), and srun having gone, the job exited 138: no requeue of a job that had saved and stopped."""
    script, env = stubbed_nodes_job(tmp_path, SRUN_EXITING_AS_THE_SIGNAL_ARRIVES, "#!/bin/bash\nexit 0\n")
    for attempt in range(RACE_TRIES):
        done = run_batch_script(script, env, tmp_path)
        assert done.returncode == 0, f"try {attempt}: rc {done.returncode}\n{done.stdout}{done.stderr}"
        assert "requeueing job 77 as segment 1" in done.stdout, done.stdout
    assert (tmp_path / "calls").read_text().count("requeue 77") == RACE_TRIES
    assert not list(tmp_path.glob(".slurm-stopped-*")), "the nodes' marks are removed"


# ------------------------------------------------------------------------------------------ Kubernetes
def _k8s_docs(manifest: str) -> dict[str, dict]:
    docs = [doc for doc in yaml.safe_load_all(manifest) if doc]
    return {doc["kind"]: doc for doc in docs}


def test_k8s_manifest_has_replicas_gpus_command_and_env(train_yaml: Path, monkeypatch) -> None:
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://minio:9000")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    options = LaunchOptions(32, "k8s", image="reg/sd:1", namespace="ml", master_port=29400)
    plan = plan_train(str(train_yaml), ["max_duration=10ba"], options)
    manifest = plan.steps[0].stdin
    assert manifest is not None and "{{" not in manifest
    docs = _k8s_docs(manifest)
    service, job = docs["Service"], docs["Job"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": "sd-train-sd2-test"}
    assert job["metadata"]["namespace"] == "ml"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 4, 4)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "sd-train-sd2-test"
    [container] = pod["containers"]
    assert container["image"] == "reg/sd:1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    # torchrun's elastic agents restart every pod's ranks together; each pod's supervisor watches and saves
    # on SIGTERM within the grace period.
    assert pod["terminationGracePeriodSeconds"] >= 30
    assert plan.supervision is not None and plan.supervision.elastic
    supervise = ["python", "-m", "shared.launch.supervise", *plan.supervision.flags(), "--"]
    assert supervise[-2] == "--elastic"
    assert container["command"] == [
        *supervise,
        "torchrun",
        "--nnodes=4",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=sd-train-sd2-test-0.sd-train-sd2-test:29400",
        "--rdzv-id=$(RDZV_ID)",
        "--rdzv-conf=join_timeout=600,read_timeout=600",
        f"--max-restarts={plan.supervision.max_restarts}",
        "-m",
        "train",
        "fit",
        str(train_yaml),
        "max_duration=10ba",
    ]
    env = {entry["name"]: entry for entry in container["env"]}
    assert "job-completion-index" in env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert "controller-uid" in env["RDZV_ID"]["valueFrom"]["fieldRef"]["fieldPath"]  # the Job's uid
    assert env["S3_ENDPOINT_URL"]["value"] == "http://minio:9000"  # passed through from the launching shell
    assert env["NCCL_SOCKET_IFNAME"]["value"] == "eth0"  # the shell's value wins over the default
    secret = env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]
    assert secret == {"name": "sd-pretrain-env", "key": "AWS_SECRET_ACCESS_KEY", "optional": True}
    assert "AWS_REGION" not in env  # unset here: not written
    assert any(f"{train_yaml} is outside this repo" in note for note in plan.notes)


def test_k8s_applies_exactly_the_rendered_manifest(train_yaml: Path, fake_bin) -> None:
    calls = fake_bin("kubectl", "job.batch/sd-train-sd2-test created")
    args = ["launch", "--config", str(train_yaml), "--gpus", "8", "--launcher", "k8s", "--image", "reg/sd:1"]
    code, out = cli(*args)
    assert code == 0, out
    plan = plan_train(str(train_yaml), [], LaunchOptions(8, "k8s", image="reg/sd:1"))
    [(kubectl_args, manifest)] = recorded(calls, "kubectl")
    assert kubectl_args == ["apply", "-f", "-"]
    assert manifest == plan.steps[0].stdin
    assert "job.batch/sd-train-sd2-test created" in out
    assert "kubectl get pods -l job-name=sd-train-sd2-test" in out


def test_a_config_file_in_the_repo_reaches_pods_and_tasks_by_its_repo_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pods run the image's copy of the repo: a path of this checkout would not exist there."""
    monkeypatch.chdir(tmp_path)  # typed from elsewhere: the absolute path is what the user gave
    config = str(REPO / "jobs" / "train" / "sd2-base-256.yaml")
    overrides = ["data.uri=s3://b/$(X) $$", "save_folder=s3://b/r"]
    plan = plan_train(config, overrides, LaunchOptions(16, "k8s", image="reg/sd:1"))
    [container] = _k8s_docs(plan.steps[0].stdin or "")["Job"]["spec"]["template"]["spec"]["containers"]
    # Kubernetes would expand $(X) and read $$ as $: written so the rank gets the override as typed
    assert container["command"][-3:] == [
        "jobs/train/sd2-base-256.yaml",
        "data.uri=s3://b/$$(X) $$$$",
        *overrides[1:],
    ]
    assert any("from the image's copy of this repo" in note for note in plan.notes)
    slurm = plan_train(config, overrides, LaunchOptions(16, "slurm")).steps[0].stdin or ""
    assert "fit jobs/train/sd2-base-256.yaml" in slurm
    # a rank resolves it from the repo root, wherever it runs
    assert load_train_config("jobs/train/sd2-base-256.yaml", []).name == "sd2-base-256"


def test_slurm_asks_for_part_of_a_node_for_fewer_gpus_than_it_holds(train_yaml: Path) -> None:
    options = LaunchOptions(2, "slurm", cpus_per_rank=3, mem_per_rank_gb=20)
    plan = plan_train(str(train_yaml), ["global_batch_size=8"], options)
    script = plan.steps[0].stdin or ""
    for line in ("--nodes=1", "--gpus-per-node=2", "--cpus-per-task=6", "--mem=40G"):
        assert f"#SBATCH {line}\n" in script
    assert "--exclusive" not in script
    whole = plan_train(str(train_yaml), [], LaunchOptions(16, "slurm", cpus_per_rank=3))
    assert "#SBATCH --exclusive\n#SBATCH --mem=0\n" in (whole.steps[0].stdin or "")
    assert any("do not change what it asks for" in note for note in whole.notes)


def test_a_checkout_path_a_slurm_script_cannot_hold_is_refused(
    train_yaml: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(steps, "repo_python", lambda: "/shared/my env/.venv/bin/python")
    with pytest.raises(LaunchError, match=r"'/shared/my env/\.venv/bin/python' has characters"):
        plan_train(str(train_yaml), [], LaunchOptions(16, "slurm"))
    plan_train(str(train_yaml), [], LaunchOptions(16, "k8s", image="reg/sd:1"))  # pods name `python`


def test_every_line_of_the_plan_prices_the_same_run() -> None:
    """Interruptions and the save's share at the rate of the estimate row, not another published one."""
    for config in ("sd2-base-256", "sd2-base-512"):
        out = summarize(
            plan_train(config, ["data.uri=s3://b/d", "save_folder=s3://b/r"], LaunchOptions(256, "slurm"))
        )
        days = re.search(r"estimate +this run: .*?: ([0-9.]+) (days|hours)", out)
        assert days, out
        value = float(days[1]) / (24 if days[2] == "hours" else 1)
        assert f"unexpected over {value:.1f} days on 256 GPUs" in out
        assert "saving every" in out and "at the estimate's" in out
        text_store = next(line for line in out.splitlines() if "text.store:" in line)
        assert "text tower over the full schedule of" in text_store and "not this run's" in text_store


def test_failed_submission_reports_the_tool_error(train_yaml: Path, tmp_path: Path, monkeypatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/bash\necho 'sbatch: error: invalid partition' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    code, out = cli("launch", "--config", str(train_yaml), "--gpus", "8", "--launcher", "slurm")
    assert code == 2
    assert "invalid partition" in out


# ------------------------------------------------------------------------------------------ templates
def test_env_vars_are_declared_once(tmp_path: Path) -> None:
    """The NCCL / EFA / S3 names live in env.yaml only; the templates get them rendered."""
    names = [var.name for var in load_env_vars(efa=True)]
    assert {"NCCL_SOCKET_IFNAME", "FI_PROVIDER", "S3_ENDPOINT_URL"} <= set(names)
    for template in TEMPLATES_DIR.iterdir():
        if template != ENV_FILE:
            text = template.read_text()
            assert not [name for name in names if name in text], template


def test_template_placeholders_indent_blocks_and_drop_empty_lines() -> None:
    text = "a: {{x}}\n  {{block}}\n{{empty}}\nend $HOME ${X:-1}\n"
    rendered = render_template(text, {"x": 1, "block": "- p\n- q", "empty": ""})
    assert rendered == "a: 1\n  - p\n  - q\nend $HOME ${X:-1}\n"
    with pytest.raises(LaunchError, match="placeholder"):
        render_template("{{missing}}", {})


# ------------------------------------------------------------------------------------------ local torchrun
def _local_plan(tmp_path: Path, options: LaunchOptions) -> LaunchPlan:
    return LaunchPlan("train", "probe", options, options.topology(), ("launch_probe", "--flag", "a b"))


@pytest.mark.dist
def test_local_launch_runs_two_cpu_ranks(tmp_path: Path) -> None:
    out, env = write_probe(tmp_path)
    step = steps.local_step(_local_plan(tmp_path, LaunchOptions(gpus=2)))
    assert "--standalone" in step.argv  # a free port: parallel runs on one machine never collide
    # As `train launch` runs it (submit.exec_step): torchrun's own log folder does not outlive it.
    subprocess.run(
        torchrun_argv(list(step.argv)), env={**env, **step.env}, check=True, timeout=PROBE_TIMEOUT_S,
        capture_output=True,
    )  # fmt: skip
    records = probe_records(out)
    assert [(r["RANK"], r["LOCAL_WORLD_SIZE"], r["NODE_RANK"]) for r in records] == [
        ("0", "2", "0"),
        ("1", "2", "0"),
    ]
    assert all(r["all_reduce"] == 3.0 and r["argv"] == ["--flag", "a b"] for r in records)


@pytest.mark.dist
def test_two_local_node_launches_meet_at_one_rendezvous(tmp_path: Path) -> None:
    out, env = write_probe(tmp_path)
    port = free_port()
    procs = []
    # Node 1 first: it only connects to the rendezvous store, which node 0 hosts once it starts. Left to
    # torchrun, both agents match 127.0.0.1 and node 1 would host it (and take it along when it is lost).
    for node_rank in (1, 0):
        options = LaunchOptions(
            gpus=2, nodes=2, node_rank=node_rank, master_addr="127.0.0.1", master_port=port
        )
        step = steps.local_step(_local_plan(tmp_path, options))
        conf = (
            f"--rdzv-conf=join_timeout=600,read_timeout=600,is_host={'true' if node_rank == 0 else 'false'}"
        )
        assert conf in step.argv
        assert "--local-addr=127.0.0.1" in step.argv  # the ranks get the address, not an FQDN to resolve
        argv = torchrun_argv(list(step.argv))
        procs.append(subprocess.Popen(argv, env={**env, **step.env}, stderr=subprocess.PIPE, text=True))
        time.sleep(2 if node_rank == 1 else 0)
    for proc in procs:
        _, err = proc.communicate(timeout=PROBE_TIMEOUT_S)
        assert proc.returncode == 0, err
    records = probe_records(out)
    # One rank per node (gpus=2 over 2 nodes); the c10d rendezvous numbers the nodes in arrival order.
    assert [(r["RANK"], r["GROUP_RANK"], r["WORLD_SIZE"]) for r in records] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert all(r["all_reduce"] == 3.0 and r["TORCHELASTIC_RUN_ID"] == "sd-train-probe" for r in records)


def test_supervise_names_node_0_the_rendezvous_host_on_slurm_and_kubernetes() -> None:
    """Left to torch, the store's host is the node whose own address matches the endpoint, decided once at
    start: a pod 0 whose Service name did not resolve yet hosted nothing, and every pod timed out."""
    from shared.launch.supervise import with_store_host

    argv = ["torchrun", "--nnodes=4", "--rdzv-conf=join_timeout=600,read_timeout=600", "-m", "train"]
    assert with_store_host(argv, "0")[2] == "--rdzv-conf=join_timeout=600,read_timeout=600,is_host=true"
    assert with_store_host(argv, "3")[2] == "--rdzv-conf=join_timeout=600,read_timeout=600,is_host=false"
    assert with_store_host(argv, None) == argv  # no node number (a local launch passes it itself)
    chosen = ["torchrun", "--rdzv-conf=is_host=false"]
    assert with_store_host(chosen, "0") == chosen


def test_a_node_reaches_the_rendezvous_by_its_address_toward_node_0() -> None:
    from shared.launch.steps import address_toward

    assert address_toward("127.0.0.1", 29500) == "127.0.0.1"
    assert address_toward(None, 29500) is None


# ------------------------------------------------------------------------------------------ fits the cluster
def test_k8s_pods_request_cpus_and_memory_of_their_ranks(train_yaml: Path) -> None:
    options = LaunchOptions(16, "k8s", image="reg/sd:1")
    plan = plan_train(str(train_yaml), ["data.num_workers=6"], options)
    [container] = _k8s_docs(plan.steps[0].stdin or "")["Job"]["spec"]["template"]["spec"]["containers"]
    # per rank: 6 workers + the rank = 7 CPUs, 24 + 2 x 6 = 36 GiB; 8 ranks per pod
    assert container["resources"] == {
        "limits": {"nvidia.com/gpu": 8},
        "requests": {"cpu": "56", "memory": "288Gi"},
    }
    flags = LaunchOptions(16, "k8s", image="reg/sd:1", cpus_per_rank=4, mem_per_rank_gb=10)
    plan = plan_train(str(train_yaml), [], flags)
    [container] = _k8s_docs(plan.steps[0].stdin or "")["Job"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {"cpu": "32", "memory": "80Gi"}


def test_k8s_efa_pods_ask_for_their_efa_interfaces(train_yaml: Path) -> None:
    """The EFA knobs alone leave a pod without an EFA device (the device plugin hands out only what a pod
    asks for): NCCL would find no EFA provider."""
    options = LaunchOptions(16, "k8s", image="reg/sd:1", efa=True, efa_devices=32)
    plan = plan_train(str(train_yaml), [], options)
    [container] = _k8s_docs(plan.steps[0].stdin or "")["Job"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}
    assert {"name": "FI_PROVIDER", "value": "efa"} in container["env"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--launcher", "k8s", "--image", "reg/sd:1", "--efa"], "--efa on Kubernetes needs --efa-devices N"),
        (["--launcher", "k8s", "--image", "reg/sd:1", "--efa-devices", "4"], "add --efa"),
        (["--launcher", "k8s", "--image", "reg/sd:1", "--efa", "--efa-devices", "0"], "must be >= 1"),
        (["--launcher", "slurm", "--efa", "--efa-devices", "4"], "--efa-devices is for Kubernetes pods"),
    ],
)
def test_efa_devices_are_asked_for_where_pods_need_them(train_yaml: Path, args, says) -> None:
    code, out = cli("launch", "--config", str(train_yaml), "--gpus", "16", "--dry-run", *args)
    assert code == 2, out
    assert says in out


def test_slurm_train_nodes_take_all_their_memory(train_yaml: Path) -> None:
    script = plan_train(str(train_yaml), [], LaunchOptions(16, "slurm")).steps[0].stdin or ""
    assert "#SBATCH --exclusive\n#SBATCH --mem=0\n" in script


def test_one_node_plan_reads_in_the_singular(train_yaml: Path) -> None:
    code, out = cli(
        "launch", "--config", str(train_yaml), "--gpus", "1", "--launcher", "slurm", "--dry-run",
        "global_batch_size=4", "device_microbatch_size=4",
    )  # fmt: skip
    assert code == 0, out
    assert "1 node x 1 GPU (world size 1)" in out
    assert "global 4 = 1 rank x 4 per rank; microbatch 4 x 1 accumulation step" in out
    assert not re.search(r"\b1 (nodes|GPUs|ranks|accumulation steps|CPUs|microbatches)\b", out), out
    assert "(s)" not in out


# ------------------------------------------------------------------------------------ injection / secrets
NEWLINE = "\n#SBATCH --qos=evil"


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--partition", "gpu" + NEWLINE], "--partition"),
        (["--account", "ml" + NEWLINE], "--account"),
        (["--time", "1-00:00:00" + NEWLINE], "--time"),
        (["--time", "1 day"], "--time"),
        (["--sbatch-option", "qos=high" + NEWLINE], "--sbatch-option"),
        (["--sbatch-option", "comment=a b"], "--sbatch-option"),
        (["--sbatch-option", "nodes=64"], "--sbatch-option"),
        (["--sbatch-option", "mem=1G"], "--mem-per-rank-gb"),
        (["data.uri=s3://b/x" + NEWLINE], "the config path / key=value overrides"),
        (["data.uri=http://user:pw123456@host/x"], "pass credentials through the environment"),
    ],
)
def test_values_that_would_inject_lines_are_refused(train_yaml: Path, fake_bin, args, flag) -> None:
    calls = fake_bin("sbatch", "1")
    code, out = cli("launch", "--config", str(train_yaml), "--gpus", "16", "--launcher", "slurm", *args)
    assert code == 2, out
    assert flag in out
    assert recorded(calls, "sbatch") == []
    assert "pw123456" not in out


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--namespace", "ml\nkind: Pod"], "--namespace"),
        (["--namespace", "ML_Team"], "--namespace"),
        (["--secret", "env\n"], "--secret"),
        (["--sbatch-option", "qos=high"], "--sbatch-option is for LAUNCHER=slurm"),
    ],
)
def test_k8s_values_are_validated(train_yaml: Path, args, flag) -> None:
    code, out = cli(
        "launch", "--config", str(train_yaml), "--gpus", "8", "--launcher", "k8s", "--image", "reg/sd:1",
        "--dry-run", *args,
    )  # fmt: skip
    assert code == 2, out
    assert flag in out


def test_a_config_path_with_a_newline_is_refused(tmp_path: Path, train_yaml: Path) -> None:
    hostile = tmp_path / "x\n#SBATCH --qos=evil.yaml"
    hostile.write_text(train_yaml.read_text())
    code, out = cli("launch", "--config", str(hostile), "--gpus", "16", "--launcher", "slurm", "--dry-run")
    assert code == 2, out
    assert "the config path / key=value overrides" in out and "control character" in out


def test_sbatch_options_reach_every_script_before_the_body(train_yaml: Path) -> None:
    options = LaunchOptions(16, "slurm", partition="gpu", sbatch_options=["qos=high", "--requeue"])
    script = plan_train(str(train_yaml), [], options).steps[0].stdin or ""
    header = script.split("set -euo pipefail")[0]
    assert "#SBATCH --partition=gpu\n#SBATCH --qos=high\n#SBATCH --requeue\n" in header


def test_placeholders_inside_values_are_written_literally(train_yaml: Path) -> None:
    plan = plan_train(str(train_yaml), ["data.uri=s3://b/{{name}}"], LaunchOptions(16, "slurm"))
    assert "s3://b/{{name}}" in (plan.steps[0].stdin or "")


PASSWORD_URL = "http://minio-user:s3cr3t-pw@minio:9000"


def test_endpoint_password_goes_through_the_secret_and_is_never_printed(
    train_yaml: Path, monkeypatch
) -> None:
    monkeypatch.setenv("S3_ENDPOINT_URL", PASSWORD_URL)
    plan = plan_train(str(train_yaml), [], LaunchOptions(16, "k8s", image="reg/sd:1"))
    manifest = plan.steps[0].stdin or ""
    assert "s3cr3t-pw" not in manifest
    [container] = _k8s_docs(manifest)["Job"]["spec"]["template"]["spec"]["containers"]
    env = {entry["name"]: entry for entry in container["env"]}
    ref = {"name": "sd-pretrain-env", "key": "S3_ENDPOINT_URL", "optional": True}
    assert env["S3_ENDPOINT_URL"] == {"name": "S3_ENDPOINT_URL", "valueFrom": {"secretKeyRef": ref}}
    assert any("kubectl create secret generic sd-pretrain-env" in note for note in plan.notes)
    code, out = cli(
        "launch", "--config", str(train_yaml), "--gpus", "16", "--launcher", "k8s", "--image", "reg/sd:1",
        "--dry-run", f"log.wandb_entity={PASSWORD_URL}",
    )  # fmt: skip
    assert code == 2 and "s3cr3t-pw" not in out and "***@" in out


def test_launcher_output_redacts_userinfo(train_yaml: Path, tmp_path: Path, monkeypatch) -> None:
    """A tool error echoing the endpoint (sbatch failing) is printed without its password."""
    monkeypatch.setenv("S3_ENDPOINT_URL", PASSWORD_URL)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        '#!/bin/bash\necho "sbatch: error: bad endpoint $S3_ENDPOINT_URL" >&2\nexit 1\n'
    )
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    code, out = cli("launch", "--config", str(train_yaml), "--gpus", "8", "--launcher", "slurm")
    assert code == 2
    assert "bad endpoint http://***@minio:9000" in out and "s3cr3t-pw" not in out


# ------------------------------------------------------------------------------------------ 256-GPU dry run
def test_sd2_dry_run_shows_communication_checkpoint_and_save_share() -> None:
    """Hand arithmetic: P = 865,910,724; W = 256 (32 nodes); bf16 params, fp32 grads; 1 GB/s per node."""
    code, out = cli(
        "launch", "--config", "sd2-base-256", "--gpus", "256", "--launcher", "slurm", "--dry-run",
        "data.uri=s3://b/d", "save_folder=s3://b/run",
    )  # fmt: skip
    assert code == 0, out
    p, ring = 865_910_724, 255 / 256
    assert f"all-gather of bf16 params {ring * p * 2 / 1e9:.3f} GB" in out  # 1.725
    assert f"reduce-scatter of fp32 grads {ring * p * 4 / 1e9:.3f} GB" in out  # 3.450
    assert f"= {ring * p * 6 / 1e9:.3f} GB" in out
    ckpt = 16 * p  # fp32 weights 4 + EMA 4 + AdamW 8 bytes per parameter
    assert f"checkpoint {ckpt / 1e9:.2f} GB" in out and f"sharded {ckpt / 256 / 1e6:.1f} MB per rank" in out
    assert f"full (rank 0) {ckpt / 1e9:.1f} s, sharded {ckpt / 32 / 1e9:.2f} s" in out
    # at the rate the plan's estimate prices (jobs/estimate/sd2-base.yaml): 137.5 img/s per A100 at 256 px
    # measured on 8, keeping 0.9010 per doubling: 5 doublings to 256. 98.0 ms; the recipe saves every 10000ba
    step, every = 2048 / (137.5 * 0.9010**5 * 256), 10_000
    full, sharded = ckpt / 1e9 / (every * step + ckpt / 1e9), ckpt / 32e9 / (every * step + ckpt / 32e9)
    assert f"(step {step * 1000:.1f} ms): full {full:.2%}, sharded {sharded:.2%} of wall time" in out
    assert "accumulation steps under FSDP" not in out  # the shipped config runs one microbatch of 8
    code, out = cli(
        "launch", "--config", "sd2-base-256", "--gpus", "256", "--launcher", "slurm", "--dry-run",
        "data.uri=s3://b/d", "device_microbatch_size=4", "fsdp_reduce_dtype=bf16", "--write-gb-per-s", "2",
        "save_folder=s3://b/run",
    )  # fmt: skip
    assert code == 0, out
    assert "2 accumulation steps under FSDP" in out and "raise device_microbatch_size to 8" in out
    # fsdp_no_sync (default): SHARD_GRAD_OP reduce-scatters once a step whatever the accumulation
    assert f"reduce-scatter of bf16 grads {ring * p * 2 / 1e9:.3f} GB" in out and "reduced once a step" in out
    assert f"full (rank 0) {ckpt / 2e9:.1f} s" in out
    code, out = cli(
        "launch", "--config", "sd2-base-256", "--gpus", "256", "--launcher", "slurm", "--dry-run",
        "data.uri=s3://b/d", "device_microbatch_size=4", "fsdp_reduce_dtype=bf16", "fsdp_no_sync=false",
        "save_folder=s3://b/run",
    )  # fmt: skip
    assert code == 0, out
    assert f"2 reduce-scatters of bf16 grads {2 * ring * p * 2 / 1e9:.3f} GB" in out
    assert "set fsdp_no_sync=true" in out


@pytest.mark.parametrize(
    ("overrides", "switch"),
    [((), None), (("fsdp=false",), "fsdp=true"), (("checkpoint_format=full",), "checkpoint_format=sharded")],
)
def test_the_full_save_note_is_for_runs_that_save_full_and_names_the_switch(
    tmp_path: Path, overrides: tuple[str, ...], switch: str | None
) -> None:
    """sd2-base-256 on 256 GPUs saves every 10000ba: full saves would cost 1.4% of wall time. The recipe
    resolves to FSDP and sharded checkpoints, so nothing is said; DDP saves full and shards only under
    fsdp=true; FSDP told to save full shards with checkpoint_format=sharded."""
    save = [f"save_folder={tmp_path}", "data.uri=s3://b/d", *overrides]
    out = summarize(plan_train("sd2-base-256", save, LaunchOptions(256, "slurm")))
    notes = [line for line in out.splitlines() if "full-state-dict saves every 10000ba" in line]
    if switch is None:
        assert notes == []
    else:
        assert len(notes) == 1 and f"with sharded checkpoints (0.04%: {switch}) or save_interval=" in notes[0]


# ------------------------------------------------------------- LAUNCHER=auto, refusals, node-local things
def fake_binary(folder: Path, name: str, body: str = "exit 0") -> None:
    (folder / name).write_text(f"#!/bin/bash\n{body}\n")
    (folder / name).chmod(0o755)


S3_SAVE = "save_folder=s3://bucket/runs/p1"


def test_auto_launcher_picks_slurm_where_sbatch_is_found_and_says_so(
    train_yaml: Path, tmp_path: Path, monkeypatch
) -> None:
    fake_binary(tmp_path, "sbatch")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    code, out = cli("launch", "--config", str(train_yaml), "--gpus", "256", "--dry-run", S3_SAVE)
    assert code == 0, out
    assert "launcher         slurm (LAUNCHER=auto: 32 nodes and `sbatch` is on PATH" in out
    assert "--rdzv-backend=c10d" in out and '"--rdzv-id=$RDZV_ID"' in out  # the sbatch script
    one = plan_train(
        str(train_yaml), ["global_batch_size=8", "device_microbatch_size=8"], LaunchOptions(1, "auto")
    )
    assert one.options.launcher == "local" and not one.options.picked  # one node stays here


def test_auto_launcher_picks_k8s_where_kubectl_has_a_context(
    train_yaml: Path, tmp_path: Path, monkeypatch
) -> None:
    fake_binary(tmp_path, "kubectl", 'echo "prod-cluster"')
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    options = LaunchOptions(16, "auto", image="reg/sd:1")
    assert (options.launcher, options.picked) == (
        "k8s",
        "2 nodes and kubectl's current context is 'prod-cluster'",
    )
    fake_binary(tmp_path, "kubectl", "exit 1")  # kubectl without a current context
    assert LaunchOptions(16, "auto").launcher == "local"


NODE_FLAGS = ("--node-rank", "--master-addr")


@pytest.mark.parametrize(
    ("environ", "variables", "expected"),
    [
        ({"MASTER_ADDR": "10.0.0.1"}, [], {}),  # left behind by torchrun or a profile: not a node's
        ({"NODE_RANK": "1"}, [], {}),
        (
            {"MASTER_ADDR": "10.0.0.1", "NODE_RANK": "1"},
            [],
            {"--node-rank": "1", "--master-addr": "10.0.0.1"},
        ),
        ({"MASTER_ADDR": "10.0.0.1"}, ["NODE_RANK=0"], {"--node-rank": "0", "--master-addr": "10.0.0.1"}),
        ({}, ["MASTER_ADDR=10.0.0.2"], {"--master-addr": "10.0.0.2"}),
        ({"MASTER_ADDR": "10.0.0.1"}, ["MASTER_ADDR=10.0.0.2"], {"--master-addr": "10.0.0.2"}),
        ({"MASTER_ADDR": "10.0.0.1", "NODE_RANK": "1"}, ["LAUNCHER=slurm"], {}),
    ],
)
def test_make_takes_a_node_address_from_its_command_line_or_with_a_node_rank(
    environ: dict[str, str], variables: list[str], expected: dict[str, str], monkeypatch
) -> None:
    """A MASTER_ADDR alone in the environment would make LAUNCHER=auto run several nodes as a local node
    that waits for the others where sbatch or kubectl would have run them: make passes it only from its
    command line or with NODE_RANK (a hand-launched node in the environment form docs/cluster.md shows)."""
    for name in ("MASTER_ADDR", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    argv = make_command("train", "GPUS=16", "NODES=2", "DRY_RUN=1", *variables)
    assert argv[argv.index("launch") :][:2] == ["launch", "--config"]
    assert {flag: argv[i + 1] for i, flag in enumerate(argv) if flag in NODE_FLAGS} == expected


def test_a_plan_of_several_nodes_says_an_environment_master_addr_was_not_used(
    train_yaml: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    fake_binary(tmp_path, "sbatch")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    code, out = cli("launch", "--config", str(train_yaml), "--gpus", "16", "--dry-run", S3_SAVE)
    assert code == 0, out
    assert "slurm (LAUNCHER=auto: 2 nodes and `sbatch` is on PATH; MASTER_ADDR=10.0.0.1 in the " in out
    assert "pass NODE_RANK too, or MASTER_ADDR=.. on make's command line (--master-addr)" in out
    (tmp_path / "sbatch").unlink()  # nothing to submit to: local, which refuses 2 nodes and says why
    code, out = cli("launch", "--config", str(train_yaml), "--gpus", "16", "--dry-run", S3_SAVE)
    assert code == 2 and "2 nodes do not fit on this machine" in out, out
    assert "MASTER_ADDR=10.0.0.1 in the environment is not used alone" in out
    code, out = cli("launch", "--config", str(train_yaml), "--gpus", "16", "--dry-run", "--master-addr",
                    "10.0.0.1", S3_SAVE)  # fmt: skip
    assert "one node of the elastic rendezvous" in out and "in the environment is not used" not in out, out


def test_a_refused_dry_run_still_prints_the_whole_plan(train_yaml: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # neither sbatch nor kubectl: local, which cannot hold 2 nodes
    code, out = cli(
        "launch", "--config", str(train_yaml), "--gpus", "16", "--dry-run", f"save_folder={tmp_path}"
    )
    assert code == 2
    assert "launch plan: train" in out and "batch            global 2048" in out and "step 1: torchrun" in out
    refused = [line for line in out.splitlines() if line.startswith("  refused")]
    assert "2 nodes do not fit on this machine" in "\n".join(refused)
    assert "is a local path and this run has 2 nodes" in "\n".join(refused)  # both reasons, each with its fix
    assert out.rstrip().splitlines()[-1].startswith("launch error:")


def test_a_local_save_folder_on_several_nodes_is_refused_unless_declared_shared(train_yaml: Path) -> None:
    local = plan_train(str(train_yaml), ["save_folder=/scratch/run"], LaunchOptions(16, "slurm"))
    assert local.refusal is not None and "save_folder=s3://" in local.refusal
    assert "--shared-save-folder" in local.refusal
    shared = LaunchOptions(16, "slurm", shared_save_folder=True)
    assert plan_train(str(train_yaml), ["save_folder=/scratch/run"], shared).refusal is None
    assert plan_train(str(train_yaml), [S3_SAVE], LaunchOptions(16, "slurm")).refusal is None
    one_node = ["save_folder=/scratch/run", "global_batch_size=8", "device_microbatch_size=1"]
    assert plan_train(str(train_yaml), one_node, LaunchOptions(8, "slurm")).refusal is None
    code, out = cli("launch", "--config", str(train_yaml), "--gpus", "16", "--launcher", "slurm", "--dry-run",
                    "--shared-save-folder", "save_folder=/scratch/run")  # fmt: skip
    assert code == 0, out
    assert "checkpoints: /scratch/run (one folder every node mounts: --shared-save-folder)" in out


def test_the_dry_run_says_where_each_node_local_thing_lives(train_yaml: Path) -> None:
    plan = plan_train(str(train_yaml), [S3_SAVE, "data.cache_dir=/nvme/cache"], LaunchOptions(16, "slurm"))
    text = summarize(plan)
    rows = [line for line in text.splitlines() if line.startswith("  node-local")]
    assert any("Streaming cache on each node: /nvme/cache" in row for row in rows)
    assert any("control folder on each node: <tmp>/sd-control-*" in row for row in rows)
    assert any("lease: one, by global rank 0" in row for row in rows)
    assert any("sample renderer's local rank 0" in row and "sd-pretrain-runs" in row for row in rows)


def test_every_multi_node_spec_uses_the_elastic_c10d_rendezvous(train_yaml: Path) -> None:
    """torchrun restarts every node together (resilience.max_restarts); the supervisor only watches."""
    overrides = [S3_SAVE, "resilience.max_restarts=5"]
    script = plan_train(str(train_yaml), overrides, LaunchOptions(16, "slurm")).steps[0].stdin or ""
    assert '--rdzv-backend=c10d "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT" "--rdzv-id=$RDZV_ID"' in script
    assert "--max-restarts=5 " in script and "--elastic" in script and "--node-rank" not in script
    assert 'RDZV_ID="sd-train-sd2-test-$SLURM_JOB_ID-$SEGMENT"' in script  # one run id per job and segment
    options = LaunchOptions(16, master_addr="10.0.0.5", master_port=29400)
    local = plan_train(str(train_yaml), overrides, options)
    argv = local.steps[0].argv
    assert (
        "--rdzv-endpoint=10.0.0.5:29400" in argv and "--max-restarts=5" in argv and "--standalone" not in argv
    )
    assert local.supervision is not None and local.supervision.elastic
    single = plan_train(str(train_yaml), [*overrides, "global_batch_size=8", "device_microbatch_size=1"])
    assert single.supervision is not None and not single.supervision.elastic  # one node: it restarts torchrun


def test_sd2_dry_run_prices_each_ranks_state_update() -> None:
    """Issue 30: the clipping + fused AdamW + EMA update is 48 B a parameter of HBM traffic a step; FSDP's
    SHARD_GRAD_OP runs 1/256 of it on each rank, DDP all of it on every rank: 26.7 ms on an A100-40GB, 8.7 ms
    on an H200, each about 2/3 of the U-Net's own 8 images at 256 px on that GPU at 35% MFU (39.8 / 12.5 ms,
    543 GFLOP an image), which gets a note; with the EMA every 10 batches, 37.2 B of which the EMA's 1.2."""
    p = 865_910_724
    base = ("launch", "--config", "sd2-base-256", "--gpus", "256", "--launcher", "slurm", "--dry-run")
    folders = ("data.uri=s3://b/d", "save_folder=s3://b/run")
    code, out = cli(*base, *folders)
    assert code == 0, out
    assert (
        "state update per rank per step (clipping norm + fused AdamW + EMA lerp, 48 B a parameter, 1/256 of "
        f"the parameters on each rank): {48 * p / 256 / 1e9:.3f} GB = 0.10 ms at the A100-40GB's 1.555 TB/s"
    ) in out
    assert "runs the whole state update on every rank" not in out
    code, out = cli(*base, *folders, "fsdp=false")
    assert code == 0, out
    assert f"every parameter on every rank): {48 * p / 1e9:.3f} GB = 26.73 ms at the A100-40GB's" in out
    device_ms = 8 * 543e9 / (312e12 * 0.35) * 1000
    assert (
        "DDP runs the whole state update on every rank: 26.7 ms a step on the A100-40GB, "
        f"{26.73 / device_ms:.0%} on top of the U-Net's own {device_ms:.1f} ms for 8 images at 256 px at 35%"
    ) in out
    code, out = cli(*base, "--gpu-type", "H200", *folders, "fsdp=false", "ema.update_interval=10ba")
    assert code == 0, out
    assert "(clipping norm + fused AdamW + EMA lerp, 37.2 B a parameter, every parameter on every" in out
    assert "DDP runs the whole state update on every rank: 6.7 ms a step on the H200, 53% on top of" in out
    assert "a longer ema.update_interval cuts only the EMA's 1.2 of the 37.2 B" in out
    code, out = cli(*base, *folders, "fsdp=false", "ema.enabled=false", "optimizer.grad_clip_norm=null")
    assert code == 0, out
    assert "state update per rank per step (fused AdamW, 28 B a parameter, every parameter on every" in out
    assert "ema.update_interval cuts" not in out
    code, out = cli(*base, *folders, "fsdp=false", "optimizer.fused=false")
    assert code == 0, out
    assert "EMA lerp, at least 48 B a parameter" in out and "optimizer.fused=false moves more" in out
