"""The train step as the job runs it, taken apart: ATen ops dispatched per step, their self time by op family
and by phase (forward + backward, clipping, optimizer, EMA), bytes they move and work left in fp32 under
autocast.

The step is `train/bench/step.py`'s (zero_grad, autocast forward + loss, backward, optimizer step) plus the
train job's gradient clipping (train/loop/clipping.py, folded into the fused AdamW where it can be) and its
EMA update (train/ema/store.py), each under a `record_function` label so the profiler can tell them apart.

Counts are the proxies a CPU can improve without a GPU: every top-level ATen op is a kernel launch on a GPU
(launch overhead dominates SD2 at 256 px), and the compiled step's count shows what inductor fused. Bytes are
each op's tensor arguments (read; an argument it only writes, `out=` or `copy_`'s destination, counts as
read too) plus what it writes: its new outputs and, by its schema, the arguments it mutates (an in-place
foreach or fused op returns nothing). An upper bound on memory traffic: caches and fusion make it less.
By phase, the clipping, optimizer and EMA bytes are each rank's state update, which
shared/estimate/cluster.py `state_update` prices per parameter. "fp32 under autocast" counts the bytes of
convolution / matmul / normalization ops whose output stays fp32 while autocast is on (GroupNorm and
LayerNorm do, `model.low_precision_norms` changes that).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from shared.runtime.device import DeviceSetup
from train.ema.store import NamedEMAStore
from train.loop.clipping import GradNormClipping
from train.model.diffusion import DiffusionModel

PHASES = ("step", "clipping", "optimizer", "ema")  # "step": zero_grad, forward, loss, backward
UPDATE_PHASES = PHASES[1:]  # each rank's state update after backward (shared/estimate/cluster.py)
EMA_SMOOTHING = 0.9999
# Op families by ATen name (first match wins); anything else computing is "elementwise".
FAMILY_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("convolution", ("convolution", "conv2d", "cudnn_conv", "mkldnn_conv", "conv_depthwise")),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention", "_softmax", "softmax")),
    ("matmul", ("addmm", "bmm", "baddbmm", "matmul", "linear", "mm")),
    ("normalization", ("group_norm", "layer_norm", "batch_norm")),
    ("optimizer", ("adam", "_fused_sgd")),
    ("copies", ("copy_", "_to_copy", "clone", "contiguous", "to", "cat", "stack")),
    ("memory", ("empty", "zeros", "ones", "full", "fill_", "zero_", "resize_")),
    ("views", ("view", "reshape", "permute", "transpose", "expand", "t", "slice", "select", "unsqueeze",
               "squeeze", "as_strided", "split", "chunk", "detach", "alias", "unbind", "narrow", "flatten",
               "_unsafe_view")),
)  # fmt: skip
FP32_WATCHED = ("convolution", "matmul", "attention", "normalization")


def family_of(op: str) -> str:
    """`aten::native_group_norm` / `aten.native_group_norm.default` -> "normalization"."""
    name = op.removeprefix("aten::").removeprefix("aten.").split(".")[0]
    for family, keys in FAMILY_RULES:
        if family in ("copies", "memory", "views"):
            if name in keys or name.rstrip("_") in keys or name.removeprefix("new_") in keys:
                return family
        elif any(key in name for key in keys):
            return family
    return "elementwise"


# --------------------------------------------------------------------------------------------- the step
@dataclass
class FullStep:
    """One optimizer step of the train job on fixed inputs: `run(labels)` labels each phase."""

    model: DiffusionModel
    optimizer: torch.optim.Optimizer
    batch: dict[str, torch.Tensor]
    setup: DeviceSetup
    clip_norm: float | None
    ema: NamedEMAStore | None = None
    clipping: GradNormClipping | None = None
    state: Any = None

    @classmethod
    def build(
        cls,
        model: DiffusionModel,
        optimizer: Any,
        batch: Any,
        setup: DeviceSetup,
        clip: Any,
        ema: bool = True,
    ) -> FullStep:
        step = cls(model, optimizer, batch, setup, clip, NamedEMAStore(model) if ema else None)
        if clip is not None:
            step.clipping = GradNormClipping(clip)
            step.state = SimpleNamespace(model=model, optimizers=[optimizer], precision=setup.precision)
            step.clipping.look_up_targets(step.state)
        return step

    def run(
        self, label: Callable[[str], AbstractContextManager[Any]] | None = None, batch: Any = None
    ) -> None:
        """`batch`: another batch than the step's own (the online step's freshly encoded one)."""
        label = label or (lambda _: nullcontext())
        batch = self.batch if batch is None else batch
        with label("step"):
            self.optimizer.zero_grad(set_to_none=True)
            with self.setup.autocast():
                loss = self.model.loss(self.model(batch), batch)
            loss.backward()
        if self.clipping is not None:
            with label("clipping"):
                self.clipping.clip_step(self.state)
        with label("optimizer"):
            self.optimizer.step()
        if self.ema is not None:
            with label("ema"):
                self.ema.lerp(self.model, EMA_SMOOTHING)


# ------------------------------------------------------------------------------------- dispatch counting
@dataclass
class DispatchTally:
    """ATen ops as dispatched (below autograd and autocast): counts, bytes and fp32-under-autocast bytes."""

    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    bytes_by_family: collections.Counter[str] = field(default_factory=collections.Counter)
    fp32_bytes_by_family: collections.Counter[str] = field(default_factory=collections.Counter)
    bytes_by_phase: collections.Counter[str] = field(default_factory=collections.Counter)
    autocast_on: bool = False
    phase: str = PHASES[0]  # FullStep.run's label of the ops being dispatched

    @contextlib.contextmanager
    def label(self, phase: str) -> Iterator[None]:
        """FullStep.run's `label`: the ops dispatched inside count for `phase`."""
        self.phase, outer = phase, self.phase
        try:
            yield
        finally:
            self.phase = outer

    def add(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        family = family_of(str(func))
        self.ops[family] += 1
        if family == "views":
            return
        moved = tensor_bytes((args, kwargs)) + written_bytes(func, args, kwargs, out)
        self.bytes_by_family[family] += moved
        self.bytes_by_phase[self.phase] += moved
        # the primary output: attention kernels also return an fp32 logsumexp whatever their dtype
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if self.autocast_on and family in FP32_WATCHED and outs and outs[0].dtype == torch.float32:
            self.fp32_bytes_by_family[family] += moved

    def to_json(self) -> dict[str, Any]:
        computing = sum(n for fam, n in self.ops.items() if fam != "views")
        return {
            "aten_ops": sum(self.ops.values()),
            "aten_ops_computing": computing,  # views launch no kernel
            "aten_ops_by_family": dict(self.ops.most_common()),
            "bytes_moved": sum(self.bytes_by_family.values()),
            "bytes_by_family": dict(self.bytes_by_family.most_common()),
            "bytes_by_phase": dict(self.bytes_by_phase),
            "fp32_bytes_under_autocast": sum(self.fp32_bytes_by_family.values()),
            "fp32_bytes_under_autocast_by_family": dict(self.fp32_bytes_by_family.most_common()),
        }


def tensor_bytes(tree: Any) -> int:
    leaves = torch.utils._pytree.tree_leaves(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def written_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes an op writes: the arguments its schema marks mutable (`Tensor(a!)`, lists too), plus each of its
    returns that is new rather than an alias of an input (an in-place op returns `self`, counted as mutated;
    a view returns memory it did not write)."""
    schema = func._schema
    values = {
        arg.name: args[i] if i < len(args) else kwargs.get(arg.name) for i, arg in enumerate(schema.arguments)
    }
    mutated = sum(
        tensor_bytes(values[arg.name])
        for arg in schema.arguments
        if arg.alias_info is not None
        and arg.alias_info.is_write
        and not _grads_left_unwritten(schema, arg.name, values)
    )
    returns = out if isinstance(out, tuple) else (out,)  # a void op returns None: no return to pair
    pairs = zip(schema.returns, returns, strict=False)
    fresh = sum(tensor_bytes(value) for ret, value in pairs if ret.alias_info is None)
    return mutated + fresh


def _grads_left_unwritten(schema: Any, name: str, values: dict[str, Any]) -> bool:
    """torch's fused optimizer kernels (`_fused_adam_`, `_fused_adamw_`, `_fused_sgd_`, `_fused_adagrad_`)
    store the gradients they read only when given a grad_scale (they write back the unscaled gradient);
    their schemas mark `grads` mutable either way."""
    return schema.name.startswith("aten::_fused_") and name == "grads" and values.get("grad_scale") is None


class TallyMode(TorchDispatchMode):
    """Every ATen op dispatched inside is added to `tally`."""

    def __init__(self, tally: DispatchTally):
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.tally.add(func, args, kwargs, out)
        return out


# Where CUDA autocast differs from CPU autocast (torch's autocast_mode.cpp lists) on ops the U-Net runs:
# CUDA keeps the norms in fp32 (what `model.low_precision_norms` changes) and runs attention in bf16.
CUDA_FP32_FUNCTIONS = {torch.nn.functional.group_norm, torch.nn.functional.layer_norm}
CUDA_LOW_FUNCTIONS = {torch.nn.functional.scaled_dot_product_attention}


def _cast_args(args: Any, dtype: torch.dtype) -> list[Any]:
    return [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


class CudaAutocastPolicy(TorchFunctionMode):
    """Under CPU autocast: GroupNorm / LayerNorm in fp32 and attention in bf16, as CUDA autocast runs them;
    calls made with autocast switched off (shared/norms.py's) run as they are."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_autocast_enabled("cpu") and func in CUDA_FP32_FUNCTIONS | CUDA_LOW_FUNCTIONS:
            dtype = torch.float32 if func in CUDA_FP32_FUNCTIONS else torch.get_autocast_dtype("cpu")
            with torch.autocast("cpu", enabled=False):
                return func(*_cast_args(args, dtype), **kwargs)
        return func(*args, **kwargs)


def cpu_autocast_like_cuda() -> AbstractContextManager[Any]:
    """CPU bf16 autocast with CUDA's policy for the norms and attention (CudaAutocastPolicy)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    stack.enter_context(CudaAutocastPolicy())
    return stack


def dispatch_tally(step: FullStep, cpu_autocast_proxy: bool = False) -> DispatchTally:
    """One eager step counted op by op (the step must have run once: optimizer state exists). On CPU,
    `cpu_autocast_proxy` runs that step under CPU bf16 autocast with CUDA's fp32 policy for the norms
    (`cpu_autocast_like_cuda`), so the fp32-under-autocast bytes mean what they would on a GPU; the train
    job itself never autocasts on CPU."""
    cuda_amp = step.setup.device.type == "cuda" and step.setup.precision != "fp32"
    proxy = cpu_autocast_proxy and step.setup.device.type == "cpu"
    tally = DispatchTally(autocast_on=cuda_amp or proxy)
    region = cpu_autocast_like_cuda() if proxy else nullcontext()
    with region, TallyMode(tally):
        step.run(tally.label)
    step.setup.sync()
    return tally
