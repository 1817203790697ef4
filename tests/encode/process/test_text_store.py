"""text.store=tokens on the real encode job: token ids instead of embeddings; latents reused on a switch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from encode.config import EncodeConfig
from encode.pipeline import RankInfo, run_rank
from encode.process.encoders import Encoders, load_encoders
from encode.process.filters import clean_caption
from encode.publish.finalize import publish
from encode.sample_data import build_webdataset
from shared import contract
from shared.config import ConfigError, load_config
from shared.manifest import read_manifest
from tests.encode.test_pipeline import HIGH, LOW, rows_by_key

SMALL = [f"filter.min_size={LOW}", f"transform.resolutions=[{LOW},{HIGH}]"]


def make_cfg(source: Path, output: Path, *overrides: str) -> EncodeConfig:
    base = [f"source.uri={source}", f"output.uri={output}", "workers=0", "progress=false", *SMALL]
    return load_config(EncodeConfig, "sample", [*base, *overrides], kind="datasets")


@pytest.fixture(scope="module")
def encoders() -> Encoders:
    return load_encoders(make_cfg(Path("unused"), Path("unused")))


@pytest.fixture(scope="module")
def wds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wds")
    build_webdataset(out, shards=2, per_shard=16, seed=5)
    return out


def encode(cfg: EncodeConfig, encoders: Encoders) -> None:
    encoders.texts_encoded = encoders.images_encoded = 0
    run_rank(cfg, RankInfo(0, 1), encoders)
    publish(cfg, encoders)


def test_switching_store_reencodes_only_text_and_keeps_latents(
    wds: Path, tmp_path: Path, encoders: Encoders
) -> None:
    out = tmp_path / "out"
    encode(make_cfg(wds, out), encoders)
    embedded = read_manifest(str(out))
    encode(make_cfg(wds, out, "text.store=tokens"), encoders)
    assert encoders.images_encoded == 0, "latents must be reused byte for byte across a text.store switch"
    manifest = read_manifest(str(out))
    assert manifest.version != embedded.version and manifest.text_store == "tokens"
    assert encoders.texts_encoded == manifest.num_samples(LOW)
    # The identity (weights hash) is recorded either way: train checks it before running the tower.
    assert manifest.identity.text_hash == embedded.identity.text_hash == encoders.ids.text
    assert manifest.identity.vae_hash == encoders.ids.vae
    assert manifest.resolutions[LOW].shapes.store == "tokens"
    expected_empty = encoders.text.tokenize([""])[0].numpy()
    np.testing.assert_array_equal(manifest.empty_caption_tokens, expected_empty)
    assert manifest.empty_caption_embedding.shape == encoders.preset.text_shape()  # samples' uncond
    for res in (LOW, HIGH):
        old, new = rows_by_key(out, res, embedded.version), rows_by_key(out, res)
        assert old.keys() == new.keys()
        for key, row in new.items():
            assert contract.TEXT_EMBEDDING not in row
            assert row[contract.TEXT_TOKENS].dtype == np.uint16
            assert row[contract.LATENT_MEAN].tobytes() == old[key][contract.LATENT_MEAN].tobytes()
            assert row[contract.LATENT_LOGVAR].tobytes() == old[key][contract.LATENT_LOGVAR].tobytes()
            ids = encoders.text.tokenize([clean_caption(row[contract.CAPTION], make_cfg(wds, out).caption)])
            np.testing.assert_array_equal(row[contract.TEXT_TOKENS], ids[0].numpy())
    # Back to embeddings: both sides come from the first version's outputs, nothing is recomputed.
    encode(make_cfg(wds, out), encoders)
    assert (encoders.texts_encoded, encoders.images_encoded) == (0, 0)
    assert read_manifest(str(out)).text_store == "embeddings"


def test_tokens_rows_are_154_bytes_of_text_at_sd2_shapes() -> None:
    sd2 = contract.Shapes((4, 32, 32), (77, 1024))
    tokens = contract.Shapes((4, 32, 32), (77, 1024), "tokens")
    assert sd2.text_bytes() == 157_696 and tokens.text_bytes() == 154
    assert contract.bytes_per_row(sd2) - contract.bytes_per_row(tokens) == 157_696 - 154
    assert contract.mds_columns(tokens)[contract.TEXT_TOKENS] == "ndarray:uint16:77"


def test_token_ids_outside_uint16_are_refused() -> None:
    with pytest.raises(ValueError, match=r"text\.store=embeddings"):
        contract.text_cell(np.array([0, 70_000]))


def test_unknown_store_is_refused(wds: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"text\.store"):
        make_cfg(wds, tmp_path / "out", "text.store=latents")
