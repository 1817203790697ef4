"""text.store=tokens: the frozen text tower run inside the train step, on the dataset's token ids.

The tower is the one the dataset's manifest names (shared/encoders.py), rebuilt from its recorded folder or
`model.text_encoder`, and refused if its weights hash differs from the recorded one. It is held by the
Objective as a plain attribute, never as a registered submodule, so its parameters are outside
`model.parameters()`: the optimizer, EMA, FSDP and checkpoints never see them. It runs under no_grad in
the precision encode ran the tower in (the manifest's `encoder.precision`: fp16 autocast on a GPU, fp32 on
CPU), not in Composer's bf16 autocast around the step: bf16's 8-bit mantissa moves embeddings by far more
than fp16's rounding of the stored path (tests/train/model/test_online_text_precision.py measures both). Its
output is rounded to the stored embedding dtype (fp16), so a step sees the embedding text.store=embeddings
would have stored: on CPU the same bits, on a GPU within one fp16 rounding of it.
"""

from __future__ import annotations

import torch

from shared.contract import TEXT_DTYPE
from shared.encoders import TOKENS, EncoderIdentity
from shared.manifest import DatasetManifest
from shared.models import TextEncoder
from shared.runtime.device import autocast

STORED_DTYPE = getattr(torch, TEXT_DTYPE)
ENCODE_PRECISION = "fp16"  # encode's default encoder.precision, for a manifest that does not record it
MISMATCH_FIX = (
    "point model.text_encoder at the diffusers folder (text_encoder/ + tokenizer/) the dataset was encoded "
    "with, or re-encode the dataset with this text encoder"
)


class OnlineText:
    """Token ids [B, L] -> what text.store=embeddings stores: [B, L, D] float32 holding fp16 values."""

    def __init__(self, encoder: TextEncoder, empty_ids: torch.Tensor, precision: str = "fp16"):
        self.encoder = encoder
        self.empty_ids = empty_ids.to(torch.int64)
        self.precision = precision  # encode's encoder.precision (module doc)

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.encoder.model.parameters())

    def embed(self, ids: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
        """Caption dropout swaps in the empty caption's ids before the tower, so a dropped sample gets
        exactly the manifest's empty-caption embedding (same tower, same rounding)."""
        if self.encoder.device != ids.device:
            self.encoder.to(ids.device)  # Composer moves the model; this tower is not part of it
        if self.empty_ids.device != ids.device:
            self.empty_ids = self.empty_ids.to(ids.device)
        # Stored as uint16; embedding lookups take int64.
        ids = torch.where(drop[:, None], self.empty_ids[None], ids.to(torch.int64))
        # The step's autocast off, encode's own on: the tower computes as it did when encode stored it.
        with (
            torch.no_grad(),
            torch.autocast(ids.device.type, enabled=False),
            autocast(ids.device, self.precision),
        ):
            return self.encoder.embed_tokens(ids).to(STORED_DTYPE).to(torch.float32)


def online_text_for(manifest: DatasetManifest, override: str | None) -> OnlineText | None:
    """The tower to run in the step for a text.store=tokens dataset; None for stored embeddings."""
    if manifest.text_store != TOKENS:
        return None
    assert manifest.empty_caption_tokens is not None  # checked with the data contract before this
    empty = torch.from_numpy(manifest.empty_caption_tokens.astype("int64"))
    precision = str(manifest.config.get("encoder", {}).get("precision", ENCODE_PRECISION))
    return load_online_text(manifest.identity, empty, override, precision)


def load_online_text(
    identity: EncoderIdentity,
    empty_ids: torch.Tensor,
    override: str | None,
    precision: str = ENCODE_PRECISION,
) -> OnlineText:
    """The dataset's text tower, verified against its recorded weights hash (on CPU, fp32, before moving)."""
    encoder = identity.build_text_encoder(override)
    identity.check_text(encoder, MISMATCH_FIX)
    return OnlineText(encoder, empty_ids, precision)
