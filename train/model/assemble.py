"""The model the train job trains, built in one place: the train job (train/loop/trainer.py) and `make bench`
(train/bench/) both call `assemble_model`, so the bench measures exactly what training runs.

Two switches shape it beyond the preset:
- `channels_last` (default: GPU only; `channels_last=true` asks for it on CPU too): every input the U-Net is
  called with in NHWC layout, the layout cuDNN's convolution kernels run natively (NCHW inputs pay a
  transpose around each conv), and, without FSDP, its weights too. Under FSDP the weights stay NCHW
  (`weights_channels_last`): FSDP flattens a parameter in memory order, and torch 2.7's optimizer-state
  loading (`_optim_utils.py`, `value.flatten()`) and the sharded EMA's shard labels read the flat parameter
  row-major, so NHWC weights would come back from a checkpoint with every 4-D conv kernel's AdamW moments
  (and EMA) permuted. A conv with an NHWC input still runs NHWC (`cudnn_conv_suggest_memory_format` looks at
  input or weight), converting its weight on the fly.
- `compile`: `torch.compile` of the U-Net alone (`nn.Module.compile`, in place). The per-sample objective
  around it is a handful of element-wise ops, not worth tracing, and compiling in place keeps every
  parameter name as it was (no `_orig_mod.` segment), so checkpoints, EMA and export do not depend on it.
  Under per-block FSDP dynamo breaks the graph at each FSDP unit, so each block is its own graph (with its
  GroupNorms, SiLUs and casts fused inside) and the glue between them a few more (train/model/kernels.py).
  `compile_cache_dir` names where inductor keeps what it compiled, so restarts and ranks reuse it.
  `compile_scope: blocks` compiles each FSDP unit on its own instead (without FSDP; `compile_unet`).
- `model.low_precision_norms`: GroupNorm / LayerNorm in the autocast dtype (shared/norms.py), swapped in
  place before compiling; a no-op outside autocast.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.transformers.transformer_2d import Transformer2DModel

from shared.models import build_unet as build_preset_unet
from shared.norms import use_low_precision_norms
from shared.presets import get_preset
from train.config import TrainConfig
from train.model.compile_plan import use_compile
from train.model.diffusion import DiffusionModel, Objective
from train.model.layout import keep_channels_last
from train.model.online_text import OnlineText

if TYPE_CHECKING:
    from diffusers import UNet2DConditionModel

log = logging.getLogger(__name__)


def is_fsdp_unit(module: torch.nn.Module) -> bool:
    """FSDP units: each transformer and ResNet block. Gathering one block's weights then overlaps the
    previous block's compute, and only a block's full weights are alive at a time in the forward; as one
    unit, the whole 866 M-parameter U-Net would be gathered at once before any compute starts."""
    return isinstance(module, (Transformer2DModel, ResnetBlock2D))


def fsdp_units(unet: torch.nn.Module) -> list[torch.nn.Module]:
    """The U-Net's FSDP units in module order (`is_fsdp_unit`), also compile_scope=blocks' regions."""
    return [m for m in unet.modules() if is_fsdp_unit(m)]


def use_channels_last(cfg: TrainConfig, device: str) -> bool:
    """`channels_last` as asked, or (null) on GPU ("gpu", Composer's device name) only."""
    if cfg.channels_last is None:
        return device == "gpu"
    return cfg.channels_last


def weights_channels_last(cfg: TrainConfig, device: str) -> bool:
    """NHWC weights only without FSDP: FSDP's flat parameters keep NCHW (module doc)."""
    return use_channels_last(cfg, device) and not cfg.fsdp


def log_layout(cfg: TrainConfig, device: str) -> None:
    if cfg.channels_last is None and device != "gpu":
        log.info("channels_last off on CPU (the default); channels_last=true runs the GPU layout here")
    elif use_channels_last(cfg, device) and cfg.fsdp:
        log.info("channels_last: NHWC inputs; weights stay NCHW in FSDP's flat parameters (docs/gpu-path.md)")


def build_unet(cfg: TrainConfig) -> UNet2DConditionModel:
    """Random init with the preset's shapes (pretraining) or model.init_from's unet/."""
    unet = build_preset_unet(get_preset(cfg.model.preset), cfg.model.init_from)
    if cfg.model.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if cfg.model.low_precision_norms:
        swapped = use_low_precision_norms(unet)
        log.info("model.low_precision_norms: %s run in the autocast dtype (shared/norms.py)", swapped)
    return unet.train()


# Inductor reads its cache folder from the environment whenever it compiles; Triton's follows it here.
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def use_compile_cache(folder: str) -> str:
    """Point inductor's (and Triton's) caches at `folder` for this process and the ranks it starts, before
    the first compile; returns the folder in use ("" leaves inductor's default)."""
    if not folder:
        return os.environ.get(INDUCTOR_CACHE_ENV, "")
    path = Path(folder).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_CACHE_ENV] = str(path)
    os.environ.setdefault(TRITON_CACHE_ENV, str(path / "triton"))
    return str(path)


def forget_compiled_code() -> None:
    """Drop dynamo's compiled code, as a new train process starts without it. A train process compiles one
    model at one resolution (plus its buckets), and `compile_unet`'s recompile limit is sized for that;
    `make bench` builds several models and resolutions in one process, where their cache entries pile up on
    the blocks' shared code objects past the limit and later blocks silently run eagerly (on the H200 the
    Composer section's blocks did: 188 ms a step against the step section's 136 ms). Inductor's on-disk
    cache stays, so compiling again is a cache hit. The CUDA graphs compile_mode=reduce-overhead captured go
    too, with their memory pool: torch 2.7's dynamo reset leaves them."""
    torch._dynamo.reset()
    if torch.cuda.is_initialized():  # no graph without CUDA; the trees' thread-local state needs CUDA's
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()


def compile_options(cfg: TrainConfig) -> dict[str, Any]:
    """torch.compile's arguments. `mode` only when not default: a backend other than inductor takes none
    (TrainConfig refuses compile_mode with one)."""
    options: dict[str, Any] = {"backend": cfg.compile_backend, "dynamic": False}
    if cfg.compile_mode != "default":
        options["mode"] = cfg.compile_mode
    return options


def compile_unet(unet: torch.nn.Module, cfg: TrainConfig) -> None:
    """`nn.Module.compile` in place, on the U-Net or (compile_scope=blocks, without FSDP) on each FSDP unit.

    Static shapes: a run feeds one shape, and under per-block FSDP each block class meets several channel
    counts; dynamo's automatic-dynamic recompile then makes C symbolic, and torch 2.7's GroupNorm backward
    decomposition fails on it (divmod of a SymInt; seen with aot_eager on 1 and 2 gloo ranks,
    tests/train/checkpoints/test_gpu_path.py). One static graph per shape instead."""
    if cfg.compile_scope == "unet" or cfg.fsdp:
        if cfg.compile_scope == "blocks":
            log.info("compile_scope=blocks: per-block FSDP already makes each block its own graph")
        unet.compile(**compile_options(cfg))
        return
    units = fsdp_units(unet)
    for unit in units:
        unit.compile(**compile_options(cfg))
    # Every unit's compiled call is one code object (nn.Module._call_impl) whose cache holds an entry per
    # block shape (and input strides) and per transformer block (their guards check the attention
    # processor's identity): SD2's 38 units make 31 (34 in NHWC), over dynamo's default limit of 8, past
    # which blocks would silently run eagerly.
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, len(units))
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, len(units) + 1)
    log.info("compile_scope=blocks: %d blocks compiled one by one (recompile_limit %d)", len(units),
             dynamo.recompile_limit)  # fmt: skip


def assemble_model(
    cfg: TrainConfig,
    device: str,
    scale_factor: float,
    empty_caption: torch.Tensor,
    online_text: OnlineText | None = None,
) -> DiffusionModel:
    """The U-Net (layout and compilation per `cfg` on `device`) with its objective, still on the host;
    `online_text`: the frozen text tower for text.store=tokens data (train/model/online_text.py)."""
    log_layout(cfg, device)
    unet = build_unet(cfg)
    if weights_channels_last(cfg, device):
        unet.to(memory_format=torch.channels_last)
    if cfg.compile is None and device != "gpu":
        log.info("compile off on CPU (compile: null); compile=true compiles here too")
    if cfg.model.keep_channels_last and use_channels_last(cfg, device) and use_compile(cfg, device):
        kept = keep_channels_last(unet)
        log.info("model.keep_channels_last: %s kept channels_last (train/model/layout.py)", kept)
    if use_compile(cfg, device):
        use_compile_cache(cfg.compile_cache_dir)
        compile_unet(unet, cfg)
    # Composer 0.32 wraps each child of the ComposerModel as its own FSDP root and looks the wrap rule up
    # on that child (the U-Net), not on the ComposerModel.
    unet.fsdp_wrap_fn = is_fsdp_unit
    objective = Objective(cfg.model, scale_factor, empty_caption, online_text)
    return DiffusionModel(unet, objective, channels_last=use_channels_last(cfg, device))
