"""The encode job's config: one nested dataclass, loaded from `jobs/datasets/<name>.yaml` + overrides.

Fields are grouped by what they fingerprint: `filter` + `caption` decide which samples exist and their text,
`caption` + the text encoder decide text embeddings, `transform` + the VAE decide latents. Changing a field
re-does only the work that depends on it (see encode/plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shared.config import ConfigError
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
    folder_partitions: int = 16
    # Encode only the first N partitions (a quick try on a huge dataset); None: all.
    max_partitions: int | None = None


@dataclass
class FilterConfig:
    """LAION / SD2-style sample selection. A threshold of None disables that check."""

    min_size: int = 256  # shorter side in px, before any resize
    max_aspect_ratio: float = 2.0  # longer side / shorter side
    max_punsafe: float | None = 0.1  # LAION-2B/5B `punsafe` (SD2 kept < 0.1)
    max_pwatermark: float | None = 0.5  # LAION-2B/5B `pwatermark`
    drop_nsfw_tags: list[str] = field(default_factory=lambda: ["NSFW"])  # LAION-400M `NSFW` column
    min_similarity: float | None = None  # LAION `similarity` (CLIP image-text score), e.g. 0.28
    # Decompression-bomb guard: images whose header claims more pixels than this are skipped, undecoded.
    max_pixels: int = 8192 * 8192
    min_caption_chars: int = 1  # after cleaning


@dataclass
class CaptionConfig:
    clean: bool = True  # unescape HTML entities, drop control characters, collapse whitespace
    max_chars: int = 1024  # longer captions are cut (the tokenizer keeps 77 tokens anyway)


@dataclass
class TransformConfig:
    # Every resolution is written as its own streamable dataset; an image smaller than a resolution is
    # absent from it (never upscaled).
    resolutions: list[int] = field(default_factory=lambda: [256, 512])
    resample: Literal["lanczos", "bicubic", "bilinear", "area"] = "bicubic"
    crop: Literal["center"] = "center"


@dataclass
class EncoderConfig:
    # diffusers folder or hub id with vae/, text_encoder/, tokenizer/ (None: the preset's default).
    pretrained: str | None = None
    text_backend: Literal["transformers", "open_clip"] = "transformers"
    open_clip_checkpoint: str | None = None  # for text_backend=open_clip with real weights
    device: str = "auto"  # auto: cuda if present, else cpu
    # Inference precision on GPU (CPU always runs fp32); outputs are stored as float16 either way.
    precision: Literal["fp32", "fp16", "bf16"] = "bf16"
    batch_size: int = 32


@dataclass
class OutputConfig:
    uri: str = ""  # local folder or s3://bucket/prefix
    compression: str | None = None  # MDS shard compression, e.g. zstd (latents compress poorly)
    shard_size_limit: int = 1 << 27  # bytes per MDS shard before it rolls over


@dataclass
class EncodeConfig:
    name: str = "dataset"
    preset: str = "sd2-base"
    source: SourceConfig = field(default_factory=SourceConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    caption: CaptionConfig = field(default_factory=CaptionConfig)
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
        if self.filter.max_aspect_ratio < 1:
            raise ConfigError("filter.max_aspect_ratio must be >= 1 (longer side / shorter side)")
        if self.encoder.batch_size < 1 or self.workers < 0:
            raise ConfigError("encoder.batch_size must be >= 1 and workers >= 0")
