"""The encode job's config: one nested dataclass, loaded from `jobs/datasets/<name>.yaml` + overrides.

Fields are grouped by what they fingerprint: `filter` + `caption` decide which samples exist and their text,
`caption` + the text encoder decide text embeddings, `transform` + the VAE decide latents. Changing a field
re-does only the work that depends on it (see encode/plan/fingerprints.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shared.buckets import auto_buckets, sort_buckets
from shared.config import ConfigError
from shared.config.values import allowed
from shared.contract import TOKEN_ID_LIMIT
from shared.presets import get_preset

SourceFormat = Literal["auto", "webdataset", "parquet", "folder"]


@dataclass
class SourceConfig:
    # Where the input is: a folder, one file, a glob (`s3://b/laion/*.tar`) or a brace range
    # (`s3://b/laion/{00000..41455}.tar`). Local paths or s3:// URIs.
    uri: str = ""
    # auto: by file extension (.tar -> webdataset, .parquet -> parquet, a folder of images -> folder).
    format: SourceFormat = "auto"
    # webdataset: member extensions tried in order for the image and the caption.
    image_exts: list[str] = field(default_factory=lambda: ["jpg", "jpeg", "png", "webp"])
    caption_ext: str = "txt"
    # parquet: column names (img2dataset writes `jpg` bytes and `caption`).
    image_column: str = "jpg"
    caption_column: str = "caption"
    key_column: str = "key"
    # folder: images are spread over this many partitions by a stable hash of their path, so adding
    # images re-encodes only the partitions they land in.
    folder_partitions: int = allowed(16, ge=1)
    # Encode only the first N partitions (a quick try on a huge dataset); None: all.
    max_partitions: int | None = allowed(None, ge=1)
    # Byte budgets, so a small hostile input cannot exhaust a worker's memory. A sample whose image,
    # caption and metadata together exceed max_sample_bytes is skipped unread ("sample_too_large"; one
    # file alone over it: "file_too_large"); tar members of extensions the sample does not use are never
    # read. Real web images are a few MB; 64 MiB leaves room for large PNGs.
    max_sample_bytes: int = allowed(64 << 20, ge=1)
    # parquet: a row group whose uncompressed size (from the file's metadata, checked before reading it)
    # exceeds this is skipped with all its rows ("row_group_too_large"). Reading takes ~3x this in memory.
    max_row_group_bytes: int = allowed(1 << 30, ge=1)
    # Stored (raw) captions are cut to this many characters, never rejected: the text encoder reads 77
    # tokens (~300 characters of English), so the cut loses nothing the model sees, while rejecting would
    # lose the image. 4x caption.max_chars leaves room for the entities and whitespace cleaning removes.
    max_caption_chars: int = allowed(4096, ge=1)


@dataclass
class FilterConfig:
    """LAION / SD2-style sample selection. A threshold of None disables that check."""

    min_size: int = 256  # shorter side in px, before any resize
    max_aspect_ratio: float = allowed(2.0, ge=1)  # longer side / shorter side
    max_punsafe: float | None = allowed(0.1, ge=0, le=1)  # LAION-2B/5B `punsafe` (SD2 kept < 0.1)
    max_pwatermark: float | None = allowed(0.5, ge=0, le=1)  # LAION-2B/5B `pwatermark`
    drop_nsfw_tags: list[str] = field(default_factory=lambda: ["NSFW"])  # LAION-400M `NSFW` column
    # LAION `similarity` (CLIP image-text cosine score), e.g. 0.28
    min_similarity: float | None = allowed(None, ge=-1, le=1)
    # A sample with no usable punsafe / pwatermark value (absent, null, NaN, not a number) while that check
    # is enabled: "admit" keeps it and counts it in the manifest's `extra.admitted_unchecked` under
    # `punsafe_missing` / `pwatermark_missing`; "reject" (fail closed) drops it under the same reason.
    missing_safety: Literal["admit", "reject"] = "admit"
    # Decompression-bomb guard: images whose header claims more pixels than this are skipped, undecoded.
    max_pixels: int = allowed(8192 * 8192, ge=1)
    min_caption_chars: int = 1  # after cleaning


@dataclass
class CaptionConfig:
    clean: bool = True  # unescape HTML entities, drop control characters, collapse whitespace
    max_chars: int = allowed(1024, ge=1)  # longer captions are cut (the tokenizer keeps 77 tokens anyway)


@dataclass
class TextConfig:
    # What is stored per sample for its caption (both keep the raw caption column):
    # - embeddings: the text tower's output, 77 x 1024 fp16 at SD2 (157,696 B; ~90% of a 256 px row);
    # - tokens: only the tokenizer's 77 ids as uint16 (154 B); train runs the frozen text tower the
    #   manifest names inside each step (~45 GFLOP/sample at SD2: +8% compute at 256 px, +2% at 512 px).
    # `make estimate` prices both. Switching re-encodes only the text side; latents are reused.
    store: Literal["embeddings", "tokens"] = "embeddings"


@dataclass
class TransformConfig:
    # Every resolution is written as its own streamable dataset; an image smaller than a resolution is
    # absent from it (never upscaled).
    resolutions: list[int] = allowed(default_factory=lambda: [256, 512], ge=8)  # px, each
    resample: Literal["lanczos", "bicubic", "bilinear", "area"] = "bicubic"
    crop: Literal["center"] = "center"
    # Aspect-ratio buckets (shared/buckets.py). "none": every image centre-cropped to a square (as before
    # buckets existed; same fingerprints). "auto": per resolution R, kohya's standard list of (H, W) with
    # about R*R pixels, sides multiples of bucket_step, aspect within filter.max_aspect_ratio. Or explicit
    # lists per resolution, e.g. {256: [[256, 256], [192, 320], [320, 192]]}. Each image goes to the
    # bucket nearest its aspect ratio, resized to cover it, centre-cropped by the least amount.
    buckets: Literal["none", "auto"] | dict[int, list[tuple[int, int]]] = "none"
    # Side step of auto buckets in px: 64 for SD (8x VAE x 8x U-Net downsampling); a multiple of the VAE's
    # downsample factor. Tiny models: 16.
    bucket_step: int = allowed(64, ge=8)

    def bucket_lists(self, max_aspect: float) -> dict[int, list[tuple[int, int]]]:
        """resolution -> its buckets; {} when square-only (buckets: none)."""
        if self.buckets == "none":
            return {}
        if self.buckets == "auto":
            return {r: auto_buckets(r, self.bucket_step, max_aspect) for r in self.resolutions}
        assert isinstance(self.buckets, dict)
        return {r: sort_buckets(tuple(b) for b in self.buckets[r]) for r in self.resolutions}


@dataclass
class EncoderConfig:
    # diffusers folder or hub id with vae/, text_encoder/, tokenizer/ (None: the preset's default).
    pretrained: str | None = None
    text_backend: Literal["transformers", "open_clip"] = "transformers"
    open_clip_checkpoint: str | None = None  # for text_backend=open_clip with real weights
    device: str = "auto"  # auto: cuda if present, else cpu
    # Inference precision on GPU (CPU always runs fp32); outputs are stored as float16 either way.
    # fp16, not bf16: training samples latent = mean + std * noise, so an error in the mean matters in
    # units of the posterior std. Measured against fp32 on the sample data (trained tiny VAE, 64/128 px,
    # 208/183 images, autocast; `latent_precision` in `make bench`): bf16 (8-bit mantissa: ~0.016 rounding
    # near 5) moved the mean by up to 0.036 = 3.0-6.6 posterior stds, 16-24% of values by > 0.1 std;
    # fp16 by up to 0.0035 = 0.27-0.43 std, 0.1-0.14% of values by > 0.1 std, nothing overflowed.
    precision: Literal["fp32", "fp16", "bf16"] = "fp16"
    # Images per model call; 0: the most the GPU's memory holds at the largest resolution (encode/process/
    # memory.py: one image's bytes measured on the GPU at start; ~48 on a 40 GB A100 at 512 px, 96 on an
    # 80 GB H100, 176 on an H200), 32 off a GPU.
    batch_size: int = allowed(32, ge=0)
    # The VAE's GroupNorms in the inference dtype instead of autocast's fp32 (shared/norms.py): half their
    # bytes, no NHWC -> NCHW copy around each on CUDA. Acts only under autocast (GPU fp16 / bf16); CPU runs
    # are unchanged. `make bench` reports the latents' error over the posterior std with it (encode section).
    low_precision_norms: bool = False
    # torch.compile the VAE encoder (inductor fuses GroupNorm + SiLU + casts); one compile per resolution,
    # the first batch of each pays it. Pays on a GPU; on CPU it only costs compile time.
    compile: bool = False


@dataclass
class OutputConfig:
    uri: str = ""  # local folder or s3://bucket/prefix
    compression: str | None = None  # MDS shard compression, e.g. zstd (latents compress poorly)
    shard_size_limit: int = allowed(1 << 27, ge=1)  # bytes per MDS shard before it rolls over
    # Finished partitions waiting for (or in) their upload + done-marker on a background thread while the
    # next partition encodes; each holds its staged shards on local disk until published. 0: publish
    # synchronously (the GPU idles during every upload).
    max_pending_uploads: int = 1


@dataclass
class EncodeConfig:
    name: str = "dataset"
    preset: str = "sd2-base"
    source: SourceConfig = field(default_factory=SourceConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    caption: CaptionConfig = field(default_factory=CaptionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    transform: TransformConfig = field(default_factory=TransformConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    workers: int = 2  # decode/resize processes overlapped with model inference
    progress: bool = True

    def __post_init__(self) -> None:
        preset = get_preset(self.preset)
        if not self.source.uri:
            raise ConfigError("source.uri is empty: set it in the dataset YAML or pass source.uri=...")
        if not self.output.uri:
            raise ConfigError("output.uri is empty: set it in the dataset YAML or pass output.uri=...")
        if not self.transform.resolutions:
            raise ConfigError("transform.resolutions is empty: list at least one, e.g. [256, 512]")
        for res in self.transform.resolutions:
            if res % preset.vae_downsample:
                raise ConfigError(
                    f"transform.resolutions has {res}, not a multiple of the {self.preset} VAE's downsample "
                    f"factor {preset.vae_downsample}"
                )
        if len(set(self.transform.resolutions)) != len(self.transform.resolutions):
            raise ConfigError(f"transform.resolutions repeats a value: {self.transform.resolutions}")
        self._check_buckets(preset.vae_downsample)
        if self.text.store not in ("embeddings", "tokens"):
            raise ConfigError(f"text.store is {self.text.store!r}; use embeddings or tokens")
        if self.text.store == "tokens" and int(preset.text["vocab_size"]) > TOKEN_ID_LIMIT:
            raise ConfigError(
                f"text.store=tokens stores uint16 ids but preset {self.preset}'s vocabulary has "
                f"{preset.text['vocab_size']} entries; use text.store=embeddings"
            )
        if self.filter.missing_safety not in ("admit", "reject"):
            raise ConfigError(f"filter.missing_safety is {self.filter.missing_safety!r}; use admit or reject")
        src = self.source
        if src.max_caption_chars < self.caption.max_chars:
            raise ConfigError(
                f"source.max_caption_chars ({src.max_caption_chars}) is below caption.max_chars "
                f"({self.caption.max_chars}); raise source.max_caption_chars or lower caption.max_chars"
            )

    def _check_buckets(self, factor: int) -> None:
        transform = self.transform
        if transform.bucket_step < 1 or transform.bucket_step % factor:
            raise ConfigError(
                f"transform.bucket_step is {transform.bucket_step}, not a positive multiple of the "
                f"{self.preset} VAE's downsample factor {factor}; use e.g. 64 (SD) or 16 (tiny)"
            )
        if isinstance(transform.buckets, dict):
            missing = sorted(set(transform.resolutions) - set(transform.buckets))
            extra = sorted(set(transform.buckets) - set(transform.resolutions))
            if missing or extra:
                raise ConfigError(
                    f"transform.buckets lists resolutions {sorted(transform.buckets)} but "
                    f"transform.resolutions is {transform.resolutions}; give one bucket list per resolution"
                )
        for res, buckets in transform.bucket_lists(self.filter.max_aspect_ratio).items():
            bad = [b for b in buckets if min(b) < 1 or b[0] % factor or b[1] % factor]
            if bad or not buckets:
                raise ConfigError(
                    f"transform.buckets at {res} px has {bad or 'no buckets'}: every bucket needs (height, "
                    f"width) sides that are positive multiples of the VAE's downsample factor {factor}"
                )
