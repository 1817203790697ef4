"""encode.process.filters: caption cleaning and LAION/SD2-style selection."""

from __future__ import annotations

import pytest

from encode.config import CaptionConfig, FilterConfig
from encode.process.filters import (
    caption_reject_reason,
    clean_caption,
    metadata_reject_reason,
    size_reject_reason,
)


@pytest.mark.parametrize(
    ("raw", "cleaned"),
    [
        ("a red circle &amp;amp; a blue square", "a red circle & a blue square"),
        ("Tom&#39;s &quot;cat&quot;", 'Tom\'s "cat"'),
        ("  tabs\tand\nnew\r\nlines  ", "tabs and new lines"),
        ("bell\x07 and nul\x00 and del\x7f", "bell and nul and del"),
        ("zero\u200bwidth\ufeff bom", "zerowidth bom"),
        ("non&nbsp;breaking\u00a0space", "non breaking space"),
        ("family \U0001f468\u200d\U0001f469", "family \U0001f468\u200d\U0001f469"),  # ZWJ kept
        ("lone \ud800 surrogate", "lone surrogate"),
        ("caf\u00e9 na\u00efve", "caf\u00e9 na\u00efve"),
    ],
)
def test_clean_caption(raw: str, cleaned: str) -> None:
    assert clean_caption(raw, CaptionConfig()) == cleaned


def test_clean_caption_cuts_and_can_be_switched_off() -> None:
    assert clean_caption("word " * 100, CaptionConfig(max_chars=12)) == "word word wo"
    assert clean_caption("abcdefgh  ", CaptionConfig(max_chars=9)) == "abcdefgh"
    raw = " raw &amp; untouched\x07 "
    assert clean_caption(raw, CaptionConfig(clean=False)) == raw


DEFAULTS = FilterConfig()


@pytest.mark.parametrize(
    ("meta", "reason"),
    [
        ({}, None),
        ({"punsafe": 0.05, "pwatermark": 0.2, "similarity": 0.3, "NSFW": "UNLIKELY"}, None),
        ({"punsafe": 0.5}, "punsafe"),
        ({"PUNSAFE": "0.5"}, "punsafe"),  # LAION spelling, numeric string
        ({"punsafe": 0.1}, None),  # not above the maximum
        ({"pwatermark": 0.8}, "pwatermark"),
        ({"PWATERMARK": 0.8}, "pwatermark"),
        ({"NSFW": "NSFW"}, "nsfw"),
        ({"nsfw": "nsfw"}, "nsfw"),
        ({"NSFW": "UNSURE"}, None),
        ({"punsafe": None, "pwatermark": "n/a", "similarity": float("nan")}, None),  # treated as missing
        ({"punsafe": True}, None),
        ({"NSFW": 1}, None),
        ({"punsafe": 0.9, "pwatermark": 0.9}, "punsafe"),  # the first failing check names the reason
    ],
)
def test_metadata_reject_reason_defaults(meta: dict, reason: str | None) -> None:
    assert metadata_reject_reason(meta, DEFAULTS) == reason


def test_metadata_thresholds_are_configurable() -> None:
    strict = FilterConfig(min_similarity=0.28, drop_nsfw_tags=["nsfw", "unsure"])
    assert metadata_reject_reason({"similarity": 0.2}, strict) == "low_similarity"
    assert metadata_reject_reason({"SIMILARITY": 0.3}, strict) is None
    assert metadata_reject_reason({"NSFW": "Unsure"}, strict) == "nsfw"
    off = FilterConfig(max_punsafe=None, max_pwatermark=None, drop_nsfw_tags=[])
    assert metadata_reject_reason({"punsafe": 1.0, "pwatermark": 1.0, "NSFW": "NSFW"}, off) is None


@pytest.mark.parametrize(
    ("size", "reason"),
    [
        ((256, 256), None),
        ((512, 256), None),  # exactly the maximum aspect ratio
        ((255, 1000), "too_small"),
        ((513, 256), "aspect_ratio"),
        ((256, 600), "aspect_ratio"),
        ((20_000, 20_000), "decompression_bomb"),
        ((0, 0), "too_small"),
    ],
)
def test_size_reject_reason(size: tuple[int, int], reason: str | None) -> None:
    assert size_reject_reason(*size, DEFAULTS) == reason


def test_size_limits_are_configurable() -> None:
    cfg = FilterConfig(min_size=64, max_aspect_ratio=3.0, max_pixels=200 * 100)
    assert size_reject_reason(64, 190, cfg) is None
    assert size_reject_reason(64, 200, cfg) == "aspect_ratio"
    assert size_reject_reason(201, 100, cfg) == "decompression_bomb"


def test_caption_reject_reason() -> None:
    assert caption_reject_reason("", DEFAULTS) == "empty_caption"
    assert caption_reject_reason("   ", DEFAULTS) == "empty_caption"
    assert caption_reject_reason("a", DEFAULTS) is None
    assert caption_reject_reason("ab", FilterConfig(min_caption_chars=3)) == "empty_caption"
    assert caption_reject_reason("", FilterConfig(min_caption_chars=0)) is None
