"""shared/contract.py: the MDS row layout through MosaicML Streaming itself, locally and on real S3."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from streaming import MDSWriter

from shared import contract, storage
from shared.contract import ContractError, Expectation, Shapes
from tests.builders.streaming import plain_streaming_dataset

SHAPES = Shapes(latent=(4, 8, 8), text=(77, 32))
NUM_ROWS = 5


def random_row(rng: np.random.Generator, index: int, shapes: Shapes = SHAPES) -> dict[str, Any]:
    return contract.make_row(
        key=f"{index:09d}",
        caption=f"caption {index} ü 東京" if index else "",
        latent_mean=rng.standard_normal(shapes.latent).astype(np.float32),
        latent_logvar=rng.uniform(-40, 30, shapes.latent).astype(np.float32),
        text_embedding=rng.standard_normal(shapes.text).astype(np.float32),
    )


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "s3":
        return request.getfixturevalue("s3_prefix") + "/256"
    return str(tmp_path / "remote" / "256")


# ------------------------------------------------------------------------------------------- columns
def test_mds_columns_fix_dtype_and_shape() -> None:
    assert contract.mds_columns(SHAPES) == {
        "key": "str",
        "caption": "str",
        "latent_mean": "ndarray:float16:4,8,8",
        "latent_logvar": "ndarray:float16:4,8,8",
        "text_embedding": "ndarray:float16:77,32",
    }


def test_bytes_per_row_counts_the_fixed_columns() -> None:
    assert contract.bytes_per_row(SHAPES) == 2 * (2 * 4 * 8 * 8) + 2 * 77 * 32


def test_shapes_json_round_trip() -> None:
    assert Shapes.from_json(SHAPES.to_json()) == SHAPES
    assert SHAPES.to_json() == {"latent": [4, 8, 8], "text": [77, 32]}


def test_rows_round_trip_through_mds(remote: str, tmp_path: Path) -> None:
    """Write with MDSWriter and read back with StreamingDataset: local, and s3:// via S3_ENDPOINT_URL."""
    rng = np.random.default_rng(0)
    rows = [random_row(rng, i) for i in range(NUM_ROWS)]
    with MDSWriter(out=remote, columns=contract.mds_columns(SHAPES), size_limit=1 << 13) as writer:
        for row in rows:
            writer.write(row)
    assert storage.exists(storage.join(remote, "index.json"))  # on S3 the writer really uploaded

    dataset = plain_streaming_dataset(
        remote=remote, local=str(tmp_path / "cache"), shuffle=False, batch_size=1
    )
    assert len(dataset) == NUM_ROWS
    for want, got in zip(rows, (dataset[i] for i in range(NUM_ROWS)), strict=True):
        assert got[contract.KEY] == want[contract.KEY]
        assert got[contract.CAPTION] == want[contract.CAPTION]
        for column, shape in [
            (contract.LATENT_MEAN, SHAPES.latent),
            (contract.LATENT_LOGVAR, SHAPES.latent),
            (contract.TEXT_EMBEDDING, SHAPES.text),
        ]:
            assert got[column].dtype == np.float16 and got[column].shape == shape
            np.testing.assert_array_equal(got[column], want[column])


@pytest.mark.parametrize(
    ("column", "bad", "message"),
    [
        (contract.LATENT_MEAN, np.zeros((4, 8, 9), np.float16), "Wrong shape"),
        (contract.TEXT_EMBEDDING, np.zeros((76, 32), np.float16), "Wrong shape"),
        (contract.LATENT_LOGVAR, np.zeros((4, 8, 8), np.float32), "Wrong dtype"),
    ],
)
def test_a_row_that_breaks_the_contract_fails_at_write(
    tmp_path: Path, column: str, bad: np.ndarray, message: str
) -> None:
    row = random_row(np.random.default_rng(1), 1)
    row[column] = bad  # bypassing make_row, as a buggy writer would
    writer = MDSWriter(out=str(tmp_path / "out"), columns=contract.mds_columns(SHAPES))
    with writer, pytest.raises(ValueError, match=message):
        writer.write(row)


# ------------------------------------------------------------------------------------------ make_row
def test_make_row_casts_and_clamps_logvar() -> None:
    logvar = np.array([-100.0, -30.0, 0.5, 20.0, 1e9], np.float64).reshape(1, 1, 5)
    row = contract.make_row("k", "c", np.ones((1, 1, 5), np.float64), logvar, np.ones((2, 3), np.float32))
    assert set(row) == {"key", "caption", "latent_mean", "latent_logvar", "text_embedding"}
    for column in (contract.LATENT_MEAN, contract.LATENT_LOGVAR, contract.TEXT_EMBEDDING):
        assert row[column].dtype == np.float16 and row[column].flags.c_contiguous
    assert row[contract.LATENT_LOGVAR].ravel().tolist() == [-30.0, -30.0, 0.5, 20.0, 20.0]


def test_make_row_accepts_non_contiguous_inputs() -> None:
    mean = np.arange(2 * 4 * 4, dtype=np.float32).reshape(4, 4, 2).transpose(2, 0, 1)  # a view
    row = contract.make_row("k", "c", mean, mean, np.zeros((2, 2)))
    assert row[contract.LATENT_MEAN].flags.c_contiguous
    np.testing.assert_array_equal(row[contract.LATENT_MEAN], mean.astype(np.float16))


# ---------------------------------------------------------------------------------- check_compatible
LATENT, TEXT = (4, 32, 32), (77, 1024)


def fake_manifest(**changes: Any) -> SimpleNamespace:
    """The fields check_compatible reads (a real DatasetManifest is exercised in test_manifest.py)."""
    fields: dict[str, Any] = {
        "contract_version": contract.CONTRACT_VERSION,
        "resolutions": {256: SimpleNamespace(shapes=Shapes(LATENT, TEXT))},
        "scale_factor": 0.18215,
        "empty_caption_embedding": np.zeros(TEXT, dtype=np.float16),
    }
    return SimpleNamespace(**{**fields, **changes})


WANT = Expectation(resolution=256, latent=LATENT, text=TEXT, scale_factor=0.18215)


def test_compatible_dataset_passes() -> None:
    contract.check_compatible(fake_manifest(), WANT)
    contract.check_compatible(fake_manifest(scale_factor=1.0), Expectation(256, LATENT, TEXT))


@pytest.mark.parametrize(
    ("manifest", "want", "named"),
    [
        (fake_manifest(contract_version=99), WANT, ["99", str(contract.CONTRACT_VERSION), "make encode"]),
        (fake_manifest(), Expectation(512, (4, 64, 64), TEXT), ["512", "256", "transform.resolutions"]),
        (fake_manifest(), Expectation(256, (8, 32, 32), TEXT), ["[4, 32, 32]", "[8, 32, 32]", "in_channels"]),
        (fake_manifest(), Expectation(256, LATENT, (77, 8)), ["[77, 1024]", "[77, 8]", "text encoder"]),
        (fake_manifest(scale_factor=0.13025), WANT, ["0.13025", "0.18215", "model.scale_factor"]),
    ],
    ids=["contract-version", "resolution", "latent-shape", "text-shape", "scale-factor"],
)
def test_each_mismatch_names_both_values_and_the_fix(
    manifest: SimpleNamespace, want: Expectation, named: list[str]
) -> None:
    with pytest.raises(ContractError) as info:
        contract.check_compatible(manifest, want)
    for text in named:
        assert re.search(re.escape(text), str(info.value)), f"{text!r} not in: {info.value}"


def test_dataset_without_resolutions_says_so() -> None:
    with pytest.raises(ContractError, match=r"it has: none"):
        contract.check_compatible(fake_manifest(resolutions={}), WANT)
