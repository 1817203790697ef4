"""The step under the torch profiler: where its time goes by phase (forward + backward, clipping, optimizer,
EMA), by op family and by kernel, and how busy the device is.

On a GPU every number is kernel time, each kernel counted once, under the CPU op that launched it: inductor's
fused kernels (Triton), cuDNN's convolutions and attention, cuBLAS's GEMMs, the optimizer's multi-tensor
kernels, and copies. The first GPU profile (issue 30, H200) summed the ATen ops' self device time instead and
counted 136 ms of kernels in a 126 ms step: the profiler also hangs each `record_function` label's GPU-side
span on its CPU event as a "kernel". Same-dtype strided copies (ATen's `direct_copy_kernel`) took 6-7% of that
step at every shape; `copy_callers_s` names the ops they run under. On CPU the times are the ATen ops' CPU
self time.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any

from train.bench.anatomy.ops import PHASES, FullStep, family_of

# Device kernels by family, from their names (first match wins; anything else is "other").
KERNEL_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fused pointwise", ("triton_poi_",)),  # inductor's generated kernels
    ("fused reduction", ("triton_red_", "triton_per_")),  # norms and their backward, bias gradients
    ("copies", ("direct_copy_kernel", "Memcpy", "nchwToNhwc", "nhwcToNchw", "copy_kernel")),
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("convolution", ("fprop", "dgrad", "wgrad", "conv", "implicit_convolve")),
    ("matmul", ("gemm", "nvjet", "cutlass", "gemv", "triton_tem_")),
    ("optimizer", ("FusedOptimizer", "fused_adam")),
    ("foreach (clipping, EMA)", ("multi_tensor_apply",)),
    ("reduction", ("reduce_kernel",)),
    ("memory", ("Memset", "fill_kernel")),
    ("elementwise", ("elementwise_kernel",)),
)
TOP_KERNELS = 12
# ATen ops a copy runs inside of without being the reason for it
COPY_WRAPPERS = (
    "aten::copy_",
    "aten::clone",
    "aten::contiguous",
    "aten::_to_copy",
    "aten::to",
    "aten::reshape",
)


def kernel_family(name: str) -> str:
    """`sm90_xmma_dgrad_implicit_gemm_bf16...` -> "convolution"; `nvjet_sm90_tst_320x128...` -> "matmul"."""
    for family, keys in KERNEL_FAMILIES:
        if any(key in name for key in keys):
            return family
    return "other"


def profile_steps(step: FullStep, steps: int) -> dict[str, Any]:
    """`steps` steps under the torch profiler: top-level ATen ops per step (a GPU launches a kernel for
    each; inductor's fused kernels are not ATen ops), and time by phase and by family in seconds per step
    (kernel time on a GPU, plus its busy time and costliest kernels; ATen CPU self time on CPU)."""
    return profile_calls(step.run, step.setup.device.type == "cuda", step.setup.sync, steps)


def profile_calls(
    run: Callable[[Any], None], cuda: bool, sync: Callable[[], None], steps: int
) -> dict[str, Any]:
    """`run(record_function)` `steps` times under the profiler, as `profile_steps` (a step that labels no
    phases counts all of it as "step")."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run(record_function)
        sync()
    events = prof.events()
    launches: collections.Counter[str] = collections.Counter()
    for event in events:
        if is_top_level_aten(event):
            launches[_phase_of(event) or "step"] += 1
    out: dict[str, Any] = {
        "time_kind": "device kernel time" if cuda else "CPU self time",
        "top_level_aten_ops_per_step": sum(launches.values()) / steps,
        "top_level_aten_ops_by_phase": {k: v / steps for k, v in launches.most_common()},
    }
    return out | (device_time(events, steps) if cuda else cpu_time(events, steps))


def python_calls(run: Callable[[], None], steps: int) -> float:
    """Python function calls per `run()` on this thread (`sys.setprofile`): the interpreter's share of the
    host's work, which ATen op counts miss (module calls, FSDP's and Composer's hooks). On a GPU the backward
    runs on autograd's device thread, whose calls (FSDP's post-backward hooks) are not counted."""
    calls = 0

    def count(_frame: Any, event: str, _arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    previous = sys.getprofile()
    sys.setprofile(count)
    try:
        for _ in range(steps):
            run()
    finally:
        sys.setprofile(previous)
    return calls / steps


def cpu_time(events: Any, steps: int) -> dict[str, Any]:
    """ATen ops' CPU self time by phase and family, and copies by the op they ran under (the CPU proxy of
    the GPU's `copy_callers_s`)."""
    by_phase: collections.Counter[str] = collections.Counter()
    by_family: collections.Counter[str] = collections.Counter()
    copy_callers: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.name.startswith("aten::"):
            seconds = event.self_cpu_time_total / 1e6 / steps
            by_phase[_phase_of(event) or "step"] += seconds
            by_family[family_of(event.name)] += seconds
            if event.name == "aten::copy_":
                copy_callers[_copy_caller(event)] += seconds
    return {
        "seconds_by_phase": dict(by_phase.most_common()),
        "seconds_by_family": dict(by_family.most_common()),
        "copy_callers_s": dict(copy_callers.most_common(TOP_KERNELS)),
    }


def device_time(events: Any, steps: int) -> dict[str, Any]:
    """Every kernel and copy on the device, once: summed (its busy time, one stream), by family, by name,
    and (through the CPU op that launched it) by phase; copies also by the op they ran under."""
    from torch.autograd import DeviceType

    on_device = [e for e in events if e.device_type == DeviceType.CUDA]
    labels = {e.name for e in on_device if e.is_user_annotation}  # GPU-side spans of record_function
    by_family: collections.Counter[str] = collections.Counter()
    by_kernel: collections.Counter[str] = collections.Counter()
    for kernel in (e for e in on_device if not e.is_user_annotation):
        seconds = kernel.device_time_total / 1e6 / steps
        by_family[kernel_family(kernel.name)] += seconds
        by_kernel[kernel.name[:120]] += seconds
    by_phase: collections.Counter[str] = collections.Counter()
    copy_callers: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.device_type != DeviceType.CPU:
            continue
        launched = [k for k in event.kernels if k.name not in labels]
        seconds = sum(k.duration for k in launched) / 1e6 / steps
        if not seconds:
            continue
        by_phase[_phase_of(event) or "step"] += seconds
        copies = sum(k.duration for k in launched if kernel_family(k.name) == "copies") / 1e6 / steps
        if copies:
            copy_callers[_copy_caller(event)] += copies
    return {
        "device_seconds_per_step": sum(by_kernel.values()),
        "device_kernels_per_step": sum(1 for e in on_device if not e.is_user_annotation) / steps,
        "seconds_by_phase": dict(by_phase.most_common()),
        "seconds_by_family": dict(by_family.most_common()),
        "top_kernels_s": dict(by_kernel.most_common(TOP_KERNELS)),
        "copy_callers_s": dict(copy_callers.most_common(TOP_KERNELS)),
    }


def _copy_caller(event: Any) -> str:
    """The op a copy ran under (cuDNN's convolution, attention's backward, a compiled graph, ...)."""
    node = event
    while node is not None and node.name in COPY_WRAPPERS:
        node = node.cpu_parent
    return node.name[:120] if node is not None else "(top level)"


def _phase_of(event: Any) -> str | None:
    node = event
    while node is not None:
        if node.name in PHASES:
            return node.name
        node = node.cpu_parent
    return None


def is_top_level_aten(event: Any) -> bool:
    if not event.name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True
