"""LAION / SD2-style sample selection and caption cleaning.

Every check returns a short snake_case reason (the key samples are counted under) or None to keep the
sample. Metadata checks only act on fields that are present and numeric: not every dataset carries LAION's
safety and watermark scores, and a dataset without them must not lose every sample. A sample passed only
because a safety score is missing is never silent: it is counted (`missing_safety_reasons`), or rejected
with `filter.missing_safety=reject`.
"""

from __future__ import annotations

import html
import math
import unicodedata
from typing import Any

from encode.config import CaptionConfig, FilterConfig

# Unicode categories removed from captions: control characters, lone surrogates (from mis-decoded bytes;
# they make tokenizers raise), and invisible format characters (zero-width spaces, BOMs, bidi overrides).
DROPPED_CATEGORIES = ("Cc", "Cs", "Cf")
# Format characters that carry meaning and stay: zero-width non-joiner / joiner (Persian, Indic, emoji).
KEPT_FORMAT_CHARS = frozenset("\u200c\u200d")
# How many times HTML entities are unescaped: scraped alt text is often double-escaped ("&amp;amp;"),
# and OpenCLIP's basic_clean unescapes twice for the same reason.
HTML_UNESCAPE_PASSES = 2


def clean_caption(text: str, cfg: CaptionConfig) -> str:
    """Unescape HTML entities (twice), drop control/invisible characters, collapse whitespace, cut."""
    if not cfg.clean:
        return text
    for _ in range(HTML_UNESCAPE_PASSES):
        text = html.unescape(text)
    text = "".join(ch for ch in text if _keep_char(ch))
    text = " ".join(text.split())
    if len(text) > cfg.max_chars:
        text = text[: cfg.max_chars].rstrip()
    return text


def _keep_char(ch: str) -> bool:
    if ch.isspace():  # tabs and newlines are control characters too, but they separate words
        return True
    return ch in KEPT_FORMAT_CHARS or unicodedata.category(ch) not in DROPPED_CATEGORIES


def _lookup(meta: dict[str, Any], name: str) -> Any:
    """A metadata field under any capitalisation (LAION writes punsafe, PUNSAFE, NSFW, nsfw, ...)."""
    if name in meta:
        return meta[name]
    for key, value in meta.items():
        if isinstance(key, str) and key.lower() == name:
            return value
    return None


def _number(value: Any) -> float | None:
    """A finite float, or None for missing / non-numeric / NaN values (treated as absent)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def metadata_reject_reason(meta: dict[str, Any], cfg: FilterConfig) -> str | None:
    """punsafe / pwatermark above their maxima, a dropped NSFW tag, or similarity below its minimum."""
    punsafe = _number(_lookup(meta, "punsafe"))
    if cfg.max_punsafe is not None and punsafe is not None and punsafe > cfg.max_punsafe:
        return "punsafe"
    pwatermark = _number(_lookup(meta, "pwatermark"))
    if cfg.max_pwatermark is not None and pwatermark is not None and pwatermark > cfg.max_pwatermark:
        return "pwatermark"
    tag = _lookup(meta, "nsfw")
    if isinstance(tag, str) and tag.strip().upper() in {t.upper() for t in cfg.drop_nsfw_tags}:
        return "nsfw"
    similarity = _number(_lookup(meta, "similarity"))
    if cfg.min_similarity is not None and similarity is not None and similarity < cfg.min_similarity:
        return "low_similarity"
    return None


def missing_safety_reasons(meta: dict[str, Any], cfg: FilterConfig) -> list[str]:
    """`punsafe_missing` / `pwatermark_missing` for each enabled safety check the sample has no value for.

    Those checks pass such a sample (a dataset without the scores must not lose every sample); the caller
    counts it under these reasons, or rejects it when `cfg.missing_safety` is "reject".
    """
    checks = (("punsafe", cfg.max_punsafe), ("pwatermark", cfg.max_pwatermark))
    return [
        f"{name}_missing"
        for name, limit in checks
        if limit is not None and _number(_lookup(meta, name)) is None
    ]


def size_reject_reason(width: int, height: int, cfg: FilterConfig) -> str | None:
    """From the header size: a decompression bomb, too small, or too far from square."""
    if width * height > cfg.max_pixels:
        return "decompression_bomb"
    short, long = min(width, height), max(width, height)
    if short < max(cfg.min_size, 1):
        return "too_small"
    if long / short > cfg.max_aspect_ratio:
        return "aspect_ratio"
    return None


def caption_reject_reason(cleaned: str, cfg: FilterConfig) -> str | None:
    """ "empty_caption" when the cleaned caption (ignoring outer whitespace) is below `min_caption_chars`."""
    if len(cleaned.strip()) < cfg.min_caption_chars:
        return "empty_caption"
    return None
