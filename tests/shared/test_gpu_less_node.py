"""A node that sees no GPU in a job of several nodes (a broken driver) is refused under device `auto` by
every job that runs ranks on several nodes (train's `fit`, `eval-images`, encode), naming both fixes; one
node of CPU ranks, or a CPU job that says so, runs."""

from __future__ import annotations

import pytest

from shared.runtime.device import DeviceError, check_node_sees_gpu, nodes_in_launch


def test_nodes_are_counted_from_the_launchers_environment() -> None:
    assert nodes_in_launch({}) == 1  # no launcher
    assert nodes_in_launch({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) == 1
    assert nodes_in_launch({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert nodes_in_launch({"WORLD_SIZE": "4"}) == 4  # no LOCAL_WORLD_SIZE: a process a node


def test_auto_on_the_cpu_of_a_node_in_a_job_of_several_is_refused_naming_the_fixes() -> None:
    with pytest.raises(DeviceError) as refused:
        check_node_sees_gpu("auto", "cpu", 2, flag="--device ")
    message = str(refused.value)
    assert "--device auto but this node (" in message and "sees no GPU, in a job of 2 nodes" in message
    assert "nvidia-smi" in message and message.endswith("or pass --device cpu for a CPU job on several nodes")
    check_node_sees_gpu("auto", "cpu", 1)  # one node of CPU ranks
    check_node_sees_gpu("cpu", "cpu", 2)  # a CPU job on several nodes, on purpose
    check_node_sees_gpu("auto", "gpu", 2)
