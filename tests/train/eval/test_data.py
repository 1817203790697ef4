"""The held-out rows and prompts: the first samples of an encoded dataset in stored order, read from its
shards (local or S3) with the same values Streaming hands training, split over ranks by index."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.contract import LATENT_MEAN, TEXT_EMBEDDING, ContractError
from tests.builders.streaming import plain_streaming_dataset
from tests.train.conftest import write_fake_dataset
from train.config import EvalConfig
from train.data.streaming_host import DataError
from train.eval.data import pin_eval_data, rank_indices, read_rows, rows_for_rank
from train.eval.images import load_prompts

# No encoder facts to compare against: these tests read rows (test_heldout.py refuses other encoders).
SAME: dict = {}


def test_rows_are_the_stored_samples_in_order(tiny_dataset: str, tmp_path: Path) -> None:
    pinned = pin_eval_data(EvalConfig(uri=tiny_dataset, num_samples=40), "tiny", 64, str(tmp_path), SAME)
    rows = read_rows(pinned, [0, 5, 33, 39])  # 33 and 39 are in the second partition
    reference = plain_streaming_dataset(local=pinned.remote, shuffle=False, batch_size=1)
    for position, index in enumerate(rows.indices):
        row = reference[index]
        assert torch.equal(rows.columns[LATENT_MEAN][position], torch.from_numpy(row[LATENT_MEAN].copy()))
        assert torch.equal(
            rows.columns[TEXT_EMBEDDING][position], torch.from_numpy(row[TEXT_EMBEDDING].copy())
        )
    assert rank_indices(5, 0, 2) == [0, 1, 2] and rank_indices(5, 1, 2) == [3, 4]
    assert rank_indices(5, 3, 4) == [] and rank_indices(2048, 255, 256) == list(range(2040, 2048))
    idle = rows_for_rank(pinned, 2, 3, 4)  # more ranks than samples: sample 0, weighing nothing
    assert idle.padding and idle.indices == [0]


def test_an_eval_dataset_that_does_not_fit_is_refused(tiny_dataset: str, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"lower eval\.num_samples"):
        pin_eval_data(EvalConfig(uri=tiny_dataset, num_samples=65), "tiny", 64, str(tmp_path), SAME)
    with pytest.raises(ContractError):  # the model trains at 128 px, the eval set has only 64 px latents
        pin_eval_data(EvalConfig(uri=tiny_dataset, num_samples=8), "tiny", 128, str(tmp_path), SAME)


def test_prompts_from_an_encoded_dataset_are_its_captions_in_order(tiny_dataset: str) -> None:
    assert load_prompts(tiny_dataset, 34) == [f"caption {i}" for i in range(34)]


def test_rows_from_s3_equal_the_local_rows(s3_prefix: str, tmp_path: Path) -> None:
    local, remote = str(tmp_path / "local"), f"{s3_prefix}/data"
    for root in (local, remote):
        write_fake_dataset(root, n=24, seed=4)
    rows = [
        read_rows(
            pin_eval_data(EvalConfig(uri=root, num_samples=20), "tiny", 64, str(tmp_path / name), SAME),
            [1, 18],
        )
        for root, name in ((local, "c1"), (remote, "c2"))
    ]
    assert all(torch.equal(rows[0].columns[k], rows[1].columns[k]) for k in rows[0].columns)
