"""Which frozen encoders a dataset was made with, as one typed record both stages read.

encode writes an `EncoderIdentity` into the dataset manifest (`encoder`); train copies it into every
checkpoint's RunRecord; train (text.store=tokens), export and sample grids rebuild the same VAE / text tower
from it and compare weights hashes. Manifests and checkpoints written before this record existed keep
working: their identity is read from the older keys (`fingerprints.encoders`, `config.encoder`,
`config.text`), and fields those lack take the defaults documented below.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from shared.presets import get_preset

if TYPE_CHECKING:
    from shared.models import TextEncoder

TextStore = Literal["embeddings", "tokens"]
EMBEDDINGS: TextStore = "embeddings"  # the text tower's output is stored per sample (77 x 1024 fp16 at SD2)
TOKENS: TextStore = "tokens"  # only the tokenizer's ids are stored (77 x uint16); train runs the tower
TEXT_STORES: tuple[TextStore, ...] = (EMBEDDINGS, TOKENS)


class EncoderMismatchError(ValueError):
    """The encoder rebuilt now is not the one the dataset was encoded with; the message names both hashes."""


@dataclass(frozen=True)
class EncoderIdentity:
    """The frozen encoders of one dataset: where their weights come from and what their weights hash to."""

    preset: str
    pretrained: str | None = None  # diffusers folder / hub id (None: the preset's own weights)
    text_backend: str = "transformers"  # "transformers" or "open_clip" (older records: transformers)
    open_clip_checkpoint: str | None = None
    vae_hash: str | None = None  # shared.models.weights_fingerprint (None: not recorded, cannot verify)
    text_hash: str | None = None  # "<backend>:<sha256>" (TextEncoder.fingerprint)
    tokenizer_hash: str | None = None
    text_store: TextStore = EMBEDDINGS  # older records: embeddings (the only mode there was)

    def __post_init__(self) -> None:
        if self.text_store not in TEXT_STORES:
            raise ValueError(f"text store {self.text_store!r} is not one of {list(TEXT_STORES)}")

    # ---------------------------------------------------------------------------------------- JSON
    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> EncoderIdentity:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in known})

    @classmethod
    def from_legacy(
        cls, preset: str, hashes: dict[str, Any], encoder_cfg: dict[str, Any], text_cfg: dict[str, Any]
    ) -> EncoderIdentity:
        """From the keys manifests kept before this record: `fingerprints.encoders` (vae, text, tokenizer),
        `config.encoder` (pretrained, text_backend, open_clip_checkpoint) and `config.text` (store)."""
        return cls(
            preset=preset,
            pretrained=encoder_cfg.get("pretrained"),
            text_backend=encoder_cfg.get("text_backend") or "transformers",
            open_clip_checkpoint=encoder_cfg.get("open_clip_checkpoint"),
            vae_hash=hashes.get("vae"),
            text_hash=hashes.get("text"),
            tokenizer_hash=hashes.get("tokenizer"),
            text_store=text_cfg.get("store") or EMBEDDINGS,
        )

    def fingerprints(self) -> dict[str, str | None]:
        """The manifest's `fingerprints.encoders` (same keys as before this record)."""
        return {"vae": self.vae_hash, "text": self.text_hash, "tokenizer": self.tokenizer_hash}

    # ----------------------------------------------------------------------------------- checkpoints
    def record(self) -> dict[str, Any]:
        """What a checkpoint's RunRecord keeps under `encoder`."""
        return self.to_json()

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> EncoderIdentity:
        """From a checkpoint's RunRecord (`encoder`, or older ones' `encoders` + `encoder_config`)."""
        if isinstance(record.get("encoder"), dict):
            return cls.from_json(record["encoder"])
        return cls.from_legacy(
            str(record.get("preset", "sd2-base")),
            dict(record.get("encoders") or {}),
            dict(record.get("encoder_config") or {}),
            {},
        )

    # ---------------------------------------------------------------------------------- rebuilding
    def source_for(self, override: str | None = None) -> str | None:
        """The diffusers folder / hub id to load from: an explicit override, else the recorded one."""
        return override or self.pretrained

    def build_text_encoder(self, override: str | None = None) -> TextEncoder:
        """The text tower (and tokenizer) this dataset names, rebuilt on CPU in fp32."""
        from shared.models import build_text_encoder

        preset = get_preset(self.preset)
        source = self.source_for(override)
        return build_text_encoder(preset, self.text_backend, source, self.open_clip_checkpoint)

    def check_text(self, encoder: TextEncoder, fix: str) -> None:
        """Refuse a text tower whose weights hash is not the recorded one (nothing recorded: accept)."""
        actual = encoder.fingerprint()
        if self.text_hash is not None and actual != self.text_hash:
            raise EncoderMismatchError(
                f"the text encoder loaded now hashes to {actual} but the dataset was encoded with "
                f"{self.text_hash}; {fix}"
            )
