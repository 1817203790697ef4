"""The train job's config: `TrainConfig`, made of the sections in data.py and sections.py."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from shared import storage
from shared.config import ConfigError
from shared.config.values import allowed
from shared.manifest import fingerprint
from shared.presets import get_preset
from train.config.checks import (
    _INTERVAL_UNITS,
    Device,
    Precision,
    time_count,
    time_string,
)
from train.config.data import DataConfig
from train.config.sections import (
    EMAConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    OptimizerConfig,
    ResilienceConfig,
    SamplesConfig,
    check_eval,
)

if TYPE_CHECKING:  # the estimate package's import is kept off the config's path
    from shared.estimate.memory import Strategy


@dataclass
class TrainConfig:
    name: str = "train"
    # A stable id for autoresume; "": <name>-<hash of save_folder>, so rerunning the same command finds it.
    run_name: str = ""
    seed: int = allowed(17, ge=0, lt=2**32)  # Composer seeds every RNG with it (0 .. 2^32 - 1)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    samples: SamplesConfig = field(default_factory=SamplesConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    global_batch_size: int = allowed(2048, ge=1)
    # Images per forward/backward on each rank; the rank's batch (global / ranks) is run in as many
    # microbatches as it takes (gradient accumulation). null: the largest that divides the rank's batch and
    # fits the GPU the run finds (its memory against the activations measured for the preset and resolution,
    # shared/estimate/memory.py; decided at start and logged, the dry-run plan for --gpu-type); on CPU, or
    # where nothing was measured, the rank's batch.
    device_microbatch_size: int | None = allowed(4, ge=1)
    max_duration: str = allowed("1ep", check=time_string())
    device: Device = "auto"
    precision: Precision = "auto"  # auto: amp_bf16 on GPU, fp32 on CPU
    # Shard with FSDP (Composer's FSDP, use_orig_params). GPUs in production; on CPU ranks (gloo) it runs
    # when asked for explicitly, which is how the test suite runs the sharded path (docs/gpu-path.md).
    # null: on when the run has more than one rank. One rank has nothing to shard: FSDP would run NO_SHARD,
    # the same memory as no FSDP, plus its per-unit hooks every step (+6,681 ATen ops and +55,826 Python
    # calls a step at SD2-base's module tree: make bench's trainer.host_twin) and NCHW conv kernels.
    fsdp: bool | None = False
    fsdp_sharding_strategy: Literal["SHARD_GRAD_OP", "FULL_SHARD", "NO_SHARD"] = "SHARD_GRAD_OP"
    # dtype FSDP reduce-scatters gradients in: fp32 (exact sums, 4 bytes per parameter per microbatch) or
    # bf16 (half the bytes; sums over many ranks lose precision). Params are gathered in `precision`'s dtype.
    fsdp_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # Under FSDP with several microbatches per step: accumulate unsharded gradients locally (FSDP's
    # no_sync) and all-gather / reduce-scatter once per step instead of once per microbatch. Costs one
    # unsharded gradient of the model per rank, accumulated in the gathered params' dtype (bf16 under
    # amp_bf16); false: reduce every microbatch in fsdp_reduce_dtype (docs/gpu-tests.md, "Accumulation").
    fsdp_no_sync: bool = True
    # Without FSDP on several ranks Composer wraps the model in DDP, which all-reduces the gradients in
    # buckets of this many MB as the backward produces them. A compiled U-Net is split by dynamo at every
    # bucket (its DDPOptimizer), so that each bucket's all-reduce overlaps the rest of the backward:
    # SD2-base's 3,303 MB of fp32 gradients make about 134 graphs at torch's default 25 MB, each compiled
    # on its own and called on its own every step (counted on 2 gloo ranks: tests/train/loop/
    # test_compiled.py). Larger buckets: fewer graphs and less host work a step, less of the all-reduce
    # overlapped. The dry-run plan says how many graphs a run makes; the job logs what its first batch
    # compiled. At least 1 MB: DDP's first bucket is 1 MB and dynamo refuses a later one smaller.
    ddp_bucket_cap_mb: float = allowed(25.0, ge=1)
    # dtype DDP all-reduces gradients in (fsdp_reduce_dtype's counterpart): fp32 (exact sums, 2 x 4 bytes a
    # parameter a step through each rank: 6.9 GB for SD2-base) or bf16 (torch's bf16_compress_hook: each
    # bucket cast to bf16 and divided by the world size before the all-reduce, cast back after; half the
    # bytes, sums over many ranks lose precision).
    ddp_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # torch.compile the U-Net (only the U-Net, in place: parameter names stay the same;
    # train/model/assemble.py). null: on for GPU runs, off on CPU (where inductor spends minutes compiling
    # C++ for no gain; logged); true / false: as asked, CPU included.
    compile: bool | None = False
    # What one graph is: unet (the whole U-Net; under per-block FSDP dynamo still breaks it at every FSDP
    # unit) or blocks (each FSDP unit, i.e. each ResNet and transformer block, compiled on its own, the glue
    # between them eager: "regional" compile): without FSDP the graphs per-block FSDP gives. Not cheaper
    # for SD2, whose blocks mostly differ in shape: on an H200 about 200 s cold against 158 s whole, and
    # 11% slower a step at 256 px (the glue eager). Under FSDP unet is used.
    compile_scope: Literal["unet", "blocks"] = "unet"
    # Where inductor keeps its compiled kernels (TORCHINDUCTOR_CACHE_DIR, and Triton's under it), so a
    # restart, a resume or another rank of the same host or shared filesystem reuses them instead of
    # compiling again; "": inductor's default, a per-user folder under /tmp of each node.
    compile_cache_dir: str = ""
    # torch.compile backend: inductor (what a GPU run wants: generated, fused kernels), or aot_eager, which
    # traces forward and backward into the same graphs and runs them with ATen's kernels: the CPU test suite
    # runs the compiled path through it in seconds instead of minutes of C++ compilation.
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    # inductor's mode (torch.compile's `mode`). default: fused kernels, launched one by one from Python.
    # reduce-overhead: also captures the compiled forward and backward as CUDA graphs (inductor's cudagraph
    # trees; a no-op on CPU), one launch per graph instead of thousands of small kernels: what NVIDIA's
    # MLPerf SD2 does for its whole step. Needs one graph per model call, so no FSDP (its hooks gather and
    # free weights between blocks) and no gradient accumulation (a graph's replay reuses the memory of the
    # gradients the last microbatch left). max-autotune(-no-cudagraphs): also benchmarks Triton templates
    # for each matmul / conv shape at compile time (minutes more per shape). `make bench BENCH=full`'s
    # `cudagraphs` variant measures reduce-overhead against the recipe.
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        "default"
    )
    # The kernels scaled_dot_product_attention runs on a GPU: auto (torch picks: cuDNN's on an H100 / H200
    # with torch 2.11), or only cudnn / flash (FlashAttention-2) / efficient (memory-efficient) / math;
    # train/model/kernels.py. `make bench BENCH=full`'s `flash_attention` variant measures flash against the
    # recipe. Ignored on CPU.
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"
    # U-Net inputs (and, without FSDP, weights) in NHWC layout, which cuDNN convolutions run natively.
    # null: on for GPU runs, off on CPU (logged); true / false: as asked, CPU included (the tests run the GPU
    # layout on CPU ranks). Under FSDP the weights stay NCHW inside the flat parameters, because torch 2.7's
    # sharded optimizer state and the sharded EMA index them row-major (docs/gpu-path.md). `make bench`
    # builds its model through the same switch.
    channels_last: bool | None = None
    # Checkpoints: a local folder or s3://bucket/prefix.
    save_folder: str = ""
    # How a checkpoint is written. full: every weight, the EMA and AdamW state are gathered onto rank 0,
    # which writes one .pt (~14 GB for SD2-base, at one node's write bandwidth). sharded: every rank writes
    # its own part in parallel into a folder per checkpoint (train/checkpoints/sharded.py); Composer writes
    # those only under FSDP. auto: sharded when fsdp=true on more than one rank, else full. Either format
    # resumes on any rank count, and a run resuming the other format converts it once at start.
    checkpoint_format: Literal["auto", "full", "sharded"] = "auto"
    save_interval: str = allowed("2500ba", check=time_string(*_INTERVAL_UNITS))
    # Also save when this many minutes passed since the last save (whichever comes first); null: batches only.
    # Bounds the work an interruption loses in minutes whatever the step time.
    save_interval_minutes: float | None = allowed(None, gt=0)
    save_num_checkpoints_to_keep: int = allowed(-1, ge=1, special={-1: "all"})  # local copies kept
    # Checkpoints kept in an s3:// save_folder (-1: all). Composer never deletes remote checkpoints; an
    # SD2-base checkpoint with EMA and AdamW state is ~14 GB, so a long run keeps a few.
    save_num_remote_checkpoints_to_keep: int = allowed(-1, ge=1, special={-1: "all"})
    # Continue from the latest checkpoint in save_folder when there is one (else start / load load_path).
    autoresume: bool = True
    # A checkpoint file or a save folder (-> its latest) to start from when there is nothing to autoresume.
    load_path: str | None = None
    # Phase handoff: take only the weights (EMA weights, see train/ema/algorithm.py) with a fresh
    # optimizer/schedule.
    load_weights_only: bool = False

    def __post_init__(self) -> None:
        self._check_model()
        check_eval(self.eval, self.model.num_train_timesteps)
        self._check_eval_is_held_out()
        if not self.save_folder:
            raise ConfigError("save_folder is empty: set it in the train YAML or pass save_folder=...")
        if self.load_weights_only and not self.load_path:
            raise ConfigError("load_weights_only=true needs load_path=<checkpoint file or save folder>")
        if self.checkpoint_format == "sharded" and self.fsdp is False:
            raise ConfigError(
                "checkpoint_format=sharded needs fsdp=true (Composer writes sharded checkpoints only under "
                "its FSDP; fsdp=null runs one rank without it); pass fsdp=true, or checkpoint_format=auto / "
                "full"
            )
        if self.device == "cpu" and self.precision.startswith("amp"):
            raise ConfigError(f"precision={self.precision} needs a GPU; CPU training runs precision=fp32")
        self._check_compile_mode()

    def _check_eval_is_held_out(self) -> None:
        """A held-out loss computed on the training data would only look like one."""
        trained = [uri for uri in (self.data.uri, *(s.uri for s in self.data.streams)) if uri]
        same = [uri for uri in trained if self.eval.uri and one_place(uri) == one_place(self.eval.uri)]
        if same:
            raise ConfigError(
                f"eval.uri={self.eval.uri} is data this run trains on ({same[0]}): its loss would not be "
                "held out; point eval.uri at a dataset encoded from samples kept out of training, or pass "
                "eval.uri=''"
            )

    def _check_compile_mode(self) -> None:
        if self.compile_mode != "default" and self.compile_backend != "inductor":
            raise ConfigError(
                f"compile_mode={self.compile_mode} is inductor's; compile_backend={self.compile_backend} has "
                "no modes: pass compile_backend=inductor, or compile_mode=default"
            )
        if self.uses_cuda_graphs() and self.fsdp:  # fsdp=null: refused once resolved for several ranks
            raise ConfigError(
                f"compile_mode={self.compile_mode} captures CUDA graphs, which FSDP's per-block gathers "
                "break into pieces it cannot replay: pass fsdp=false (one GPU, or DDP), or "
                "compile_mode=default / max-autotune-no-cudagraphs"
            )

    def uses_cuda_graphs(self) -> bool:
        """compile_mode captures the compiled U-Net's calls as CUDA graphs (on a GPU, when compiled)."""
        return self.compile_mode in ("reduce-overhead", "max-autotune")

    def _check_model(self) -> None:
        try:
            get_preset(self.model.preset).latent_shape(self.data.resolution)
        except ValueError as err:  # unknown preset, or a resolution the VAE cannot downsample evenly
            raise ConfigError(f"model.preset / data.resolution: {err}") from err
        model = self.model
        if model.zero_terminal_snr and model.prediction_type != "v_prediction":
            raise ConfigError(
                "model.zero_terminal_snr=true gives the last timestep zero signal, which epsilon prediction "
                "cannot learn; set model.prediction_type=v_prediction"
            )
        if model.beta_start >= model.beta_end:
            raise ConfigError(
                f"model.beta_start ({model.beta_start}) must be below model.beta_end ({model.beta_end})"
            )
        if model.keep_channels_last and not model.low_precision_norms:
            raise ConfigError(
                "model.keep_channels_last rewrites the low-precision GroupNorm: "
                "set model.low_precision_norms=true"
            )

    def eval_batch_size(self) -> int:
        """(sample, timestep) pairs per eval forward on each rank."""
        return self.eval.batch_size or self.device_microbatch_size

    # ------------------------------------------------------------------------------------ derived values
    def resolved_run_name(self) -> str:
        """Stable across reruns of the same command: autoresume looks for this run's checkpoints."""
        return self.run_name or f"{self.name}-{fingerprint(self.save_folder.rstrip('/'))[:8]}"

    def shuffle_seed(self) -> int:
        """The seed of the data order: data.shuffle_seed, else the run's seed."""
        return self.seed if self.data.shuffle_seed is None else self.data.shuffle_seed

    def uses_fsdp(self, world_size: int) -> bool:
        """fsdp as asked, or (null) when the run has more than one rank: one has nothing to shard."""
        return world_size > 1 if self.fsdp is None else self.fsdp

    def for_world(self, world_size: int) -> TrainConfig:
        """This config as a run on `world_size` ranks trains it: fsdp decided (a null fsdp meets the checks
        an explicit one does, e.g. CUDA graphs refused under FSDP)."""
        if self.fsdp is not None:
            return self
        return replace(self, fsdp=self.uses_fsdp(world_size))

    def strategy(self, world_size: int) -> Strategy:
        """How a run on `world_size` ranks holds its state: its FSDP sharding strategy, or DDP (also one
        unwrapped rank)."""
        return self.fsdp_sharding_strategy if self.uses_fsdp(world_size) else "DDP"

    def with_microbatch_for(self, world_size: int, memory_gb: float | None) -> TrainConfig:
        """device_microbatch_size decided (null: the largest dividing the rank's batch that fits `memory_gb`,
        the GPU's memory; the rank's batch on CPU, memory_gb None, or where nothing was measured). Call it
        on a config whose fsdp is decided (for_world): FSDP shards the resident state."""
        if self.device_microbatch_size is not None:
            return self
        from shared.estimate.memory import microbatch_that_fits

        # (an uneven split is refused, naming the fix, where the batching is derived)
        per_rank = max(1, self.global_batch_size // world_size)
        preset, resolution = self.model.preset, self.data.resolution
        fits = memory_gb and microbatch_that_fits(
            memory_gb, preset, resolution, per_rank, world_size, self.strategy(world_size)
        )
        return replace(self, device_microbatch_size=fits or per_rank)

    def resolved_checkpoint_format(self, world_size: int) -> Literal["full", "sharded"]:
        """checkpoint_format with auto decided: sharded under FSDP on more than one rank (where a full
        checkpoint would funnel ~14 GB through rank 0 at every save), else full."""
        if self.checkpoint_format != "auto":
            return self.checkpoint_format
        return "sharded" if self.uses_fsdp(world_size) and world_size > 1 else "full"

    def save_is_remote(self) -> bool:
        return storage.is_s3(self.save_folder)

    def ema_update_every(self) -> int:
        return time_count(self.ema.update_interval)

    def ema_smoothing_per_update(self) -> float:
        """Per-update smoothing that keeps ema.smoothing's half-life in optimizer steps."""
        return self.ema.smoothing ** self.ema_update_every()


def one_place(uri: str) -> str:
    """One spelling of a dataset location: s3:// as given without a trailing /, a local path absolute."""
    return uri.rstrip("/") if storage.is_s3(uri) else os.path.abspath(uri)
