"""How a run's compiled U-Net is split into graphs: Composer's DDP wrap with the run's gradient bucket size
(`ddp_bucket_cap_mb`) and reduce dtype (`ddp_reduce_dtype`), and the count of graphs the first batch
compiled, logged.

Composer 0.32.1 wraps the model in `DistributedDataParallel(module, find_unused_parameters=...)` when it
trains without FSDP on more than one rank (composer/distributed/dist_strategy.py `prepare_ddp_module`), at
torch's default 25 MB buckets, with no way to pass another size. Once the U-Net is compiled, the bucket size
decides the graphs too: a compiled frame called inside DDP's forward is split by dynamo's DDPOptimizer at
every bucket boundary, so each bucket's all-reduce can start while the rest of the backward runs. On 2 gloo
ranks the slim SD2 tree (32.5 MB of fp32 parameters) compiled 3 graphs at 25 MB, 9 at 4 MB and 27 at 1 MB;
SD2-base's 3,303 MB make about 134 at 25 MB (train/model/compile_plan.py `ddp_graphs`): 134 compiles, and
134 graph calls forward and backward a step, where the one-GPU bench's `no_fsdp` variant measures one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from composer.core import Callback, State
from composer.loggers import Logger

log = logging.getLogger(__name__)
TORCH_DEFAULT_BUCKET_MB = 25.0  # DistributedDataParallel's bucket_cap_mb when none is given


@contextlib.contextmanager
def composer_ddp(bucket_cap_mb: float, reduce_dtype: str = "fp32") -> Iterator[None]:
    """Around `Trainer(...)`: Composer's DDP wrap (more than one rank, no FSDP) uses `bucket_cap_mb`, and
    all-reduces in bf16 where `reduce_dtype` says so."""
    from composer.trainer import trainer as composer_trainer
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel

    original = composer_trainer.prepare_ddp_module

    def wrap(module: torch.nn.Module, find_unused_parameters: bool) -> torch.nn.Module:
        if not any(p.requires_grad for p in module.parameters()):
            return original(module, find_unused_parameters)
        log.info("DDP: gradients all-reduced in buckets of %s MB (ddp_bucket_cap_mb)", bucket_cap_mb)
        # torch's own default only when not passed: then DDP keeps a 1 MB first bucket (the parameters
        # defined first, whose gradients come last), as dynamo's split does; any size passed is every bucket's
        cap = None if bucket_cap_mb == TORCH_DEFAULT_BUCKET_MB else bucket_cap_mb
        # Gradients as views into the all-reduce buckets: no copy of each gradient into its bucket every
        # step (686 copy kernels for SD2's U-Net; counted on 2 gloo ranks, a bare step of its module tree
        # dispatched 6,845 top-level ATen ops with copies, 6,159 without, 4,787 without DDP), and no second
        # fp32 copy of the gradients in memory (3.46 GB for SD2-base), which the memory plan never counted.
        ddp = DistributedDataParallel(
            module,
            find_unused_parameters=find_unused_parameters,
            bucket_cap_mb=cap,
            gradient_as_bucket_view=True,
        )
        if reduce_dtype == "bf16":
            log.info("DDP: gradients all-reduced in bf16 (ddp_reduce_dtype): half the bytes of fp32")
            ddp.register_comm_hook(None, bf16_compress_hook)  # None: the default process group
        return ddp

    composer_trainer.prepare_ddp_module = wrap
    try:
        yield
    finally:
        composer_trainer.prepare_ddp_module = original


class CompiledGraphsLog(Callback):
    """After the first batch, logs how many graphs torch.compile built: one per FSDP unit, per DDP bucket
    and per graph break (AOT autograd's compiles), and dynamo's frames. Later recompiles add to both."""

    def __init__(self) -> None:
        self.logged = False

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.logged:
            return
        self.logged = True
        counters: Any = torch._dynamo.utils.counters
        log.info(
            "compile: the first batch compiled %d graphs (%d dynamo frames)",
            counters["aot_autograd"]["total"],
            counters["stats"]["unique_graphs"],
        )
