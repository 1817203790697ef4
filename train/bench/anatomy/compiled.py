"""What compiling the U-Net costs and buys: compile time of its forward + backward (the first step over a
steady one), graphs, graph breaks, recompiles after the first step, and ATen ops per step vs eager.

Dynamo's own counters (`torch._dynamo.utils.counters`) are read: `stats.unique_graphs` (graphs compiled),
`graph_break` (reasons, each a break), `recompiles` (a cache entry's guards failed). The backend is a
setting: `inductor` is what a run uses (on CPU it compiles C++ and takes minutes on 2 cores); `aot_eager`
traces forward and backward the same way without generating code, for graph, break and recompile counts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from shared.runtime.environ import restored_environ
from train.model.assemble import INDUCTOR_CACHE_ENV, TRITON_CACHE_ENV, forget_compiled_code, use_compile_cache


def _dynamo_counts() -> dict[str, int]:
    counters = torch._dynamo.utils.counters
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": int(sum(counters["recompiles"].values())),
    }


def graph_break_reasons() -> list[str]:
    return sorted(str(reason)[:200] for reason in torch._dynamo.utils.counters["graph_break"])


def compile_anatomy(
    unet: torch.nn.Module,
    run_step: Callable[[], None],
    sync: Callable[[], None],
    backend: str,
    steps: int,
    cache_dir: str = "",
) -> dict[str, Any]:
    """Compile `unet` in place with `backend`, then time its first step (compilation included) and `steps`
    more; counts as in the module doc. `run_step` runs one full train step on the model holding `unet`.
    `cache_dir` serves this compile only: the sections after it compile into the bench's cache again, the
    one precompile's children filled (switching for good made every later variant compile cold)."""
    with restored_environ((INDUCTOR_CACHE_ENV, TRITON_CACHE_ENV)):
        use_compile_cache(cache_dir)
        return _compile_and_time(unet, run_step, sync, backend, steps)


def _compile_and_time(
    unet: torch.nn.Module, run_step: Callable[[], None], sync: Callable[[], None], backend: str, steps: int
) -> dict[str, Any]:
    forget_compiled_code()
    torch._dynamo.utils.counters.clear()
    unet.compile(backend=backend, dynamic=False)  # as the train job compiles it (train/model/assemble.py)
    start = time.perf_counter()
    run_step()
    sync()
    first_s = time.perf_counter() - start
    after_first = _dynamo_counts()
    seconds = []
    for _ in range(max(steps, 1)):
        start = time.perf_counter()
        run_step()
        sync()
        seconds.append(time.perf_counter() - start)
    after_all = _dynamo_counts()
    steady = statistics.median(seconds)
    return {
        "backend": backend,
        "first_step_s": first_s,
        "steady_step_s": steady,
        # forward + backward compile time: what the first step costs beyond a compiled step
        "compile_s": max(0.0, first_s - steady),
        **after_first,
        "graphs_after_first_step": after_all["graphs"] - after_first["graphs"],
        "recompiles_after_first_step": after_all["recompiles"] - after_first["recompiles"],
        "graph_break_reasons": graph_break_reasons(),
    }


def conv_backward_layouts(unet: torch.nn.Module, run_step: Callable[[], None]) -> dict[str, int]:
    """The layouts the compiled step's backward hands cuDNN: compile `unet` in place with a backend that
    reads AOT autograd's backward graphs (what inductor sees, with its decompositions), run one step, and
    count the `aten.convolution_backward` calls fed an NCHW gradient or input. Inductor passes a fallback
    op its tensors at the graph's strides, and cuDNN converts each NCHW one to NHWC first: on the H200 those
    copies were 7% of the step (train/model/layout.py)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    counts = {"convolution_backwards": 0, "nchw_gradient": 0, "nchw_input": 0}

    def read_backward(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.aten.convolution_backward.default:
                grad, given = (arg.meta.get("val") for arg in node.args[:2])
                counts["convolution_backwards"] += 1
                counts["nchw_gradient"] += not _nhwc(grad)
                counts["nchw_input"] += not _nhwc(given)
        return make_boxed_func(gm)

    forward = lambda gm, _inputs: make_boxed_func(gm)  # noqa: E731
    backend = aot_autograd(
        fw_compiler=forward, bw_compiler=read_backward, decompositions=select_decomp_table()
    )
    forget_compiled_code()
    try:
        unet.compile(backend=backend, dynamic=False)
        run_step()
    finally:
        forget_compiled_code()
    return counts


def _nhwc(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_contiguous(memory_format=torch.channels_last)
