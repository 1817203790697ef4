"""The step's profile (train/bench/anatomy/profile.py): on a GPU, kernel time by family, phase and name, each
kernel counted once. The GPU branch runs on the profiler's own event objects, built here as a CUDA profile
of the step lays them out: no GPU needed."""

from __future__ import annotations

import itertools
import sys

from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from train.bench.anatomy.profile import device_time, kernel_family, python_calls

# Kernels of the compiled SD2 step on an H200 (torch 2.11, cuDNN attention), as the profiler names them
H200_KERNELS = {
    "triton_poi_fused_cat_gelu_gelu_backward_mul_split_view_13": "fused pointwise",
    "triton_red_fused_native_group_norm_3": "fused reduction",
    "triton_per_fused_native_layer_norm_7": "fused reduction",
    "sm90_xmma_wgrad_indexed_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128": "convolution",
    "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize256x128x64": "convolution",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1": "attention",
    "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT": "matmul",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
    "direct_copy_kernel_cuda(at::TensorIteratorBase&)": "copies",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor": "optimizer",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::TensorListMetadata<3>, TernaryOpScalarFunctor": "foreach (clipping, EMA)",
}


def test_device_kernels_are_given_their_family() -> None:
    """A compiled step's work runs in inductor's, cuDNN's and cuBLAS's kernels, not in ATen ops it can be
    read from: the GPU profile sorts kernels by name."""
    assert {name: kernel_family(name) for name in H200_KERNELS} == H200_KERNELS


H200_KERNELS_BY_FAMILY = {family: name for name, family in H200_KERNELS.items()}


EVENT_IDS = itertools.count(1)  # a CPU op's id links it to the kernels it launched


def _cpu(name: str, start: int, end: int, parent: FunctionEvent | None = None) -> FunctionEvent:
    event = FunctionEvent(next(EVENT_IDS), name, thread=1, start_us=start, end_us=end, use_device="cuda")
    if parent is not None:
        event.set_cpu_parent(parent)
        parent.append_cpu_child(event)
    return event


def _on_device(name: str, start: int, end: int, annotation: bool = False) -> FunctionEvent:
    return FunctionEvent(
        0, name, thread=7, start_us=start, end_us=end, use_device="cuda", device_type=DeviceType.CUDA,
        is_user_annotation=annotation,
    )  # fmt: skip


def test_each_kernel_counts_once_by_family_phase_and_caller() -> None:
    """A 100 us step: attention 40 us (its backward copying grad_out first: 10 us), a fused GroupNorm
    20 us, AdamW 30 us. The profiler also hangs each label's GPU-side span on the label's CPU event as if
    it were a kernel (the "step" label: 70 us), which the first H200 profile counted on top."""
    step = _cpu("step", 0, 100)
    attention = _cpu("aten::_scaled_dot_product_cudnn_attention_backward", 10, 60, step)
    copy = _cpu("aten::copy_", 12, 20, _cpu("aten::contiguous", 11, 21, attention))
    norm = _cpu("triton_red_fused_native_group_norm_3", 61, 70, step)
    optimizer = _cpu("optimizer", 70, 100)
    adamw = _cpu("aten::_fused_adamw_", 71, 99, optimizer)
    kernels = [
        (copy, H200_KERNELS_BY_FAMILY["copies"], 10),
        (attention, H200_KERNELS_BY_FAMILY["attention"], 30),
        (norm, "triton_red_fused_native_group_norm_3", 20),
        (adamw, H200_KERNELS_BY_FAMILY["optimizer"], 30),
    ]
    on_device = [_on_device("step", 0, 70, annotation=True)]
    step.append_kernel("step", 0, 70)  # the label's span, linked to its CPU event
    for event, name, us in kernels:
        event.append_kernel(name, 0, us)
        on_device.append(_on_device(name, 0, us))
    events = [step, *step.cpu_children, copy.cpu_parent, copy, optimizer, adamw, *on_device]
    out = device_time(events, steps=1)
    us = lambda seconds: round(seconds * 1e6)  # noqa: E731
    assert us(out["device_seconds_per_step"]) == 90 and out["device_kernels_per_step"] == 4
    assert {k: us(v) for k, v in out["seconds_by_phase"].items()} == {"step": 60, "optimizer": 30}
    assert {k: us(v) for k, v in out["seconds_by_family"].items()} == {
        "attention": 30, "optimizer": 30, "fused reduction": 20, "copies": 10,
    }  # fmt: skip
    assert {k: us(v) for k, v in out["copy_callers_s"].items()} == {attention.name: 10}
    assert len(out["top_kernels_s"]) == 4


def test_python_calls_counts_the_calls_a_step_makes_on_this_thread() -> None:
    def leaf() -> None:
        pass

    def step() -> None:
        for _ in range(10):
            leaf()

    # step itself and its 10 leaves (builtins such as range are C calls, not counted)
    assert python_calls(step, 3) == 11
    assert sys.getprofile() is None  # the caller's profiler (none here) is back
