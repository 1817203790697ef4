"""FID, KID and CLIP score (issue 25): torchmetrics' numbers from one Inception network whose features
are computed once, a set against itself at ~0, and CLIP score as computed by hand from open_clip."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from train.eval import quality, reference
from train.eval.quality import ClipScorer, extract, fid, inception, kid


def images(seed: int, count: int, size: int = 32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, 3, size, size), generator=gen, dtype=torch.uint8)


def test_fid_and_kid_equal_torchmetrics_on_the_images(inception_weights: str) -> None:
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    net = inception(inception_weights)
    real, fake = images(0, 4), images(1, 3)
    ref_fid = FrechetInceptionDistance(feature=net)
    ref_kid = KernelInceptionDistance(feature=net, subset_size=3, subsets=quality.KID_SUBSETS)
    for metric in (ref_fid, ref_kid):
        metric.update(real, real=True)
        metric.update(fake, real=False)
    real_f, fake_f = extract(net, real, batch=3), extract(net, fake, batch=3)
    ours = fid(real_f, fake_f)  # each FID is an eigendecomposition of a 2048 x 2048 matrix: ~15 s on 1 core
    assert ours == pytest.approx(float(ref_fid.compute()), rel=1e-4) and ours > 1e-3
    torch.manual_seed(0)
    expected = ref_kid.compute()
    assert kid(real_f, fake_f, seed=0) == pytest.approx((float(expected[0]), float(expected[1])), rel=1e-4)
    assert fid(real_f, real_f) == pytest.approx(0.0, abs=1e-3)  # a set against itself
    assert quality.kid_subset_size(6, 5) == 5 and quality.kid_subset_size(5000, 3000) == 1000


def test_inception_weights_must_be_a_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="inception-weights"):
        inception(str(tmp_path / "missing.pth"))


def test_clip_score_equals_a_hand_computation(clip_model: str) -> None:
    import open_clip
    from PIL import Image

    scorer = ClipScorer(clip_model)
    pictures = [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in images(2, 3, 48)]
    prompts = ["a red circle", "a blue square", "a photo of a dog"]
    got = scorer.scores(pictures, prompts, batch=2)
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{clip_model}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{clip_model}")
    with torch.no_grad():
        image_f, text_f, _ = model.eval()(torch.stack([preprocess(p) for p in pictures]), tokenizer(prompts))
    expected = [max(100 * float(image_f[i] @ text_f[i]), 0.0) for i in range(3)]
    assert got.tolist() == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_reference_formats_read_the_same_images(reference_images: str, tmp_path: Path) -> None:
    folder = reference.reference_bytes(reference_images, 0)
    tar_path = tmp_path / "shard-00000.tar"
    with tarfile.open(tar_path, "w") as tar:
        for i, data in enumerate(folder):
            for name, payload in ((f"{i:05d}.png", data), (f"{i:05d}.txt", b"caption")):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    pq.write_table(pa.table({"jpg": folder, "caption": ["c"] * len(folder)}), tmp_path / "00000.parquet")
    assert reference.reference_bytes(str(tar_path), 0) == folder
    assert reference.reference_bytes(str(tmp_path / "00000.parquet"), 3) == folder[:3]
    assert reference.decode_resized(folder[0], 64).shape == (3, 64, 64)
    with pytest.raises(ValueError, match="at least 2"):
        reference.reference_bytes(str(Path(reference_images) / "ref000.png"), 0)


def test_reference_features_are_cached_by_content(
    reference_images: str, inception_weights: str, tmp_path: Path
) -> None:
    calls = []

    def extract_counted(batch: torch.Tensor) -> torch.Tensor:
        calls.append(len(batch))
        return batch.float().mean(dim=(2, 3))

    first, cached = reference.reference_features(
        reference_images, 4, 16, inception_weights, extract_counted, str(tmp_path)
    )
    assert not cached and calls == [4]
    again, cached = reference.reference_features(
        reference_images, 4, 16, inception_weights, extract_counted, str(tmp_path)
    )
    assert cached and calls == [4] and torch.equal(first, again)
    _, cached = reference.reference_features(
        reference_images, 5, 16, inception_weights, extract_counted, str(tmp_path)
    )
    assert not cached and calls == [4, 5]  # other images: another key
