"""The typed encoder identity: written into manifests and checkpoints, read back from old ones too."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shared.contract import ContractError, Shapes, check_manifest_values
from shared.encoders import EncoderIdentity, EncoderMismatchError
from shared.manifest import DatasetManifest, ResolutionInfo

IDENTITY = EncoderIdentity(
    preset="tiny",
    pretrained="/models/sd2",
    text_backend="open_clip",
    open_clip_checkpoint="/models/vit-h.bin",
    vae_hash="v" * 64,
    text_hash="open_clip:" + "t" * 64,
    tokenizer_hash="open_clip:" + "k" * 64,
    text_store="tokens",
)


def manifest(**kwargs: object) -> DatasetManifest:
    base = dict(
        version="v1",
        created="2024-01-01T00:00:00Z",
        preset="tiny",
        scale_factor=0.5,
        resolutions={64: ResolutionInfo(8, Shapes((4, 8, 8), (77, 32), "tokens"), 100, 0, "f")},
        rejected={},
        samples_read=8,
        fingerprints={"dataset": "d", "encoders": IDENTITY.fingerprints()},
        empty_caption_embedding=np.zeros((77, 32), np.float16),
        partitions=[],
        config={"preset": "tiny"},
        encoder=IDENTITY,
        empty_caption_tokens=np.arange(77, dtype=np.uint16),
    )
    return DatasetManifest(**{**base, **kwargs})  # type: ignore[arg-type]


def test_manifest_round_trip_keeps_identity_tokens_and_old_keys() -> None:
    obj = json.loads(json.dumps(manifest().to_json()))
    back = DatasetManifest.from_json(obj)
    assert back.encoder == IDENTITY and back.text_store == "tokens"
    np.testing.assert_array_equal(back.empty_caption_tokens, np.arange(77))
    assert back.resolutions[64].shapes.store == "tokens"
    # The keys readers used before the record existed are still written, with the same meaning.
    assert obj["fingerprints"]["encoders"] == {
        "vae": "v" * 64,
        "text": IDENTITY.text_hash,
        "tokenizer": IDENTITY.tokenizer_hash,
    }


def test_old_manifest_without_record_reads_identity_from_old_keys() -> None:
    obj = manifest().to_json()
    for key in ("encoder", "empty_caption_tokens"):
        obj.pop(key)
    obj["resolutions"]["64"]["shapes"].pop("store")
    obj["config"] = {"preset": "tiny", "encoder": {"pretrained": "/m", "text_backend": "transformers"}}
    old = DatasetManifest.from_json(obj)
    assert old.identity == EncoderIdentity(
        preset="tiny", pretrained="/m", vae_hash="v" * 64, text_hash=IDENTITY.text_hash,
        tokenizer_hash=IDENTITY.tokenizer_hash,
    )  # fmt: skip
    assert old.text_store == "embeddings" and old.resolutions[64].shapes.store == "embeddings"
    assert old.empty_caption_tokens is None


def test_checkpoint_record_round_trip_and_old_records() -> None:
    assert EncoderIdentity.from_record({"encoder": IDENTITY.record()}) == IDENTITY
    legacy = {
        "preset": "tiny",
        "encoders": {"vae": "a", "text": "b"},
        "encoder_config": {"pretrained": None, "text_backend": "transformers", "device": "cpu"},
    }
    assert EncoderIdentity.from_record(legacy) == EncoderIdentity("tiny", vae_hash="a", text_hash="b")


def test_tokens_manifest_without_empty_caption_ids_is_refused() -> None:
    with pytest.raises(ContractError, match="empty_caption_tokens"):
        check_manifest_values(manifest(empty_caption_tokens=None), (77, 32))
    with pytest.raises(ContractError, match="empty_caption_tokens"):
        check_manifest_values(manifest(empty_caption_tokens=np.zeros(5, np.uint16)), (77, 32))


def test_unknown_store_and_text_hash_mismatch_name_the_fix() -> None:
    with pytest.raises(ValueError, match="text store"):
        EncoderIdentity("tiny", text_store="latents")  # type: ignore[arg-type]

    class Tower:
        def fingerprint(self) -> str:
            return "transformers:other"

    with pytest.raises(EncoderMismatchError, match=r"transformers:other.*open_clip:t+.*model\.text_encoder"):
        IDENTITY.check_text(Tower(), "pass model.text_encoder=<the folder encode used>")  # type: ignore[arg-type]
