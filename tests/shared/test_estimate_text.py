"""text.store priced by the planner, checked against the numbers of issue 12 (SD2-base, LAION-5B subset).

Sources: shapes from shared/contract.py at SD2-base (77 x 1024 fp16 text, 4 x 32 x 32 fp16 latents), the
LAION-5B-sized subset of jobs/estimate/sd2-base.yaml (790 M samples at 256 px, 300 M at 512 px), S3
Standard $0.023/GiB-month, the best published 256 px throughput 184.6 img/s per A100 (NOTES: ~185) on
256 GPUs, text tower ~45 GFLOP vs U-Net step 543 / 2,413 GFLOP per sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.estimate import estimate, load_estimate_config
from shared.estimate.report import render_table
from shared.estimate.text_store import flop_ideal_ratio

PUBLISHED_256_RATE = 184.6
SD2_TEXT_EMBEDDING_BYTES = 77 * 1024 * 2
SD2_TOKEN_BYTES = 77 * 2


def sd2(*overrides: str):
    return estimate(load_estimate_config("sd2-base", list(overrides)))


def test_sd2_laion_storage_and_reads_match_the_issue() -> None:
    est = sd2("gpus=256", f"throughput.per_gpu.256={PUBLISHED_256_RATE}", "scaling.per_resolution.256=1.0")
    cmp = est.text_store
    assert cmp is not None
    emb, tok = cmp.embeddings, cmp.tokens
    assert emb.bytes_per_sample[256] == pytest.approx(174_300)  # ~174 KB, 90% of it the text embedding
    assert SD2_TEXT_EMBEDDING_BYTES / emb.bytes_per_sample[256] == pytest.approx(0.90, abs=0.01)
    assert emb.storage_tib == pytest.approx(186, abs=0.5)
    assert emb.text_share == pytest.approx(0.84, abs=0.005)
    assert emb.storage_dollars_per_month == pytest.approx(4_400, rel=0.01)  # ~$4.4k / month
    assert emb.read_gb_s_cluster[256] == pytest.approx(8.2, abs=0.1)  # ~8 GB/s at 184.6 x 256
    assert emb.read_mb_s_per_node[256] == pytest.approx(8 * emb.read_mb_s_per_gpu[256])
    assert tok.bytes_per_sample[256] - emb.bytes_per_sample[256] == SD2_TOKEN_BYTES - SD2_TEXT_EMBEDDING_BYTES
    assert tok.storage_tib < emb.storage_tib / 6
    assert emb.extra_gpu_hours == 0 and tok.extra_gpu_hours > 0


def test_text_tower_adds_8_percent_at_256_and_2_percent_at_512() -> None:
    cfg = load_estimate_config("sd2-base")
    assert flop_ideal_ratio(cfg.text, 256) == pytest.approx(1.08, abs=0.005)
    assert flop_ideal_ratio(cfg.text, 512) == pytest.approx(1.02, abs=0.005)
    est = sd2()
    cmp = est.text_store
    assert cmp is not None and cmp.ratio_source == "FLOP-ideal"
    p1, p2 = est.phases
    assert cmp.tokens.extra_gpu_hours == pytest.approx(p1.gpu_hours * 45 / 543 + p2.gpu_hours * 45 / 2413)
    assert cmp.tokens.extra_dollars == pytest.approx(cmp.tokens.extra_gpu_hours * est.price_per_gpu_hour)


def test_cheaper_mode_and_break_even_follow_months_kept() -> None:
    kept = sd2("storage.months=3").text_store
    assert kept is not None and kept.cheaper == "tokens"
    even = kept.break_even_months
    saved = kept.embeddings.storage_dollars_per_month - kept.tokens.storage_dollars_per_month
    assert even == pytest.approx(kept.tokens.extra_dollars / saved)
    short = sd2(f"storage.months={even / 2}").text_store
    assert short is not None and short.cheaper == "embeddings"
    assert "break-even" in kept.line() and "tokens is cheaper" in kept.line()


def test_measured_bench_ratio_replaces_the_flop_ideal(tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({
        "device": "NVIDIA A100-SXM4-40GB",
        "train": {"256": {"images_per_s_per_device": 137.5}, "512": {"images_per_s_per_device": 36.25}},
        "text_store": {"256": {"ratio": 1.2}, "512": {"ratio": 1.05}},
    }))  # fmt: skip
    cmp = sd2(f"throughput_from={bench}").text_store
    assert cmp is not None and cmp.ratio_source == "bench" and cmp.step_ratio == {256: 1.2, 512: 1.05}


def test_make_estimate_prints_the_comparison() -> None:
    text = render_table(sd2())
    assert "text.store" in text and "embeddings" in text and "tokens" in text and "break-even" in text
