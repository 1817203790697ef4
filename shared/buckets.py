"""Aspect-ratio buckets: the (height, width) pixel shapes a resolution's images are stored at.

A bucketed resolution R holds each image at the bucket nearest its aspect ratio (compared in log space, so
4:3 and 3:4 are equally far from square), resized to cover the bucket and centre-cropped by the least
amount. Buckets have about R*R pixels and sides that are multiples of a step (kohya sd-scripts'
`--bucket_reso_steps`, 64 for SD: the VAE's 8x times the U-Net's three 2x downsamplings). Encode writes
one MDS stream per bucket; train reads one Streaming stream per bucket so each batch holds one shape.

Names: a bucket is "HxW" in pixels (e.g. "192x320": landscape), the form metrics (`data/buckets/<HxW>`),
folders and manifests use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Bucket = tuple[int, int]  # (height, width) in pixels


def bucket_name(bucket: Bucket) -> str:
    return f"{bucket[0]}x{bucket[1]}"


def parse_bucket(name: str) -> Bucket:
    """ "HxW" -> (H, W); ValueError naming the form otherwise."""
    parts = name.split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"bucket name {name!r} is not HxW in pixels, e.g. 192x320")
    return int(parts[0]), int(parts[1])


def auto_buckets(resolution: int, step: int, max_aspect: float) -> list[Bucket]:
    """kohya's standard list: for every width a multiple of `step`, the tallest multiple of `step` that keeps
    the area within resolution^2, kept when its aspect ratio is within `max_aspect` (both orientations).

    256 px, step 64, max 2.0: 256x256, 192x320, 320x192. 512 px: 512x512, 448x576, 384x640 and their
    transposes. The square is always in.
    """
    area = resolution * resolution
    found = {(resolution, resolution)}
    for width in range(step, int(resolution * max_aspect) + 1, step):
        height = (area // width) // step * step
        if height >= step and max(height, width) / min(height, width) <= max_aspect:
            found |= {(height, width), (width, height)}
    return sort_buckets(found)


def sort_buckets(buckets: Iterable[Bucket]) -> list[Bucket]:
    """Portrait to landscape (by aspect ratio), one order everywhere (stream order, manifests, reports)."""
    return sorted(set(buckets), key=lambda b: (b[1] / b[0], b))


def landscape_and_portrait(counts: dict[str, int]) -> list[str]:
    """Of "HxW" -> samples, the landscape and the portrait bucket with the most samples (either missing when
    there is none): the shapes sample grids render besides the square."""
    found = []
    for wide in (True, False):
        names = [n for n in counts if (parse_bucket(n)[1] > parse_bucket(n)[0]) == wide]
        names = [n for n in names if parse_bucket(n)[0] != parse_bucket(n)[1]]
        if names:
            found.append(max(names, key=lambda n: counts[n]))
    return found


def nearest_bucket(width: int, height: int, buckets: Sequence[Bucket]) -> Bucket:
    """The bucket whose aspect ratio is nearest the image's, in log space; ties go to the larger area."""
    ratio = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b[1] / b[0]) - ratio), -b[0] * b[1]))


def cover_box(width: int, height: int, bucket: Bucket) -> tuple[float, float, float, float] | None:
    """The (left, top, right, bottom) box of the image that, scaled down, exactly covers `bucket`: the
    whole image along the side that binds, centred along the other. None if covering needs an upscale."""
    bucket_h, bucket_w = bucket
    scale = max(bucket_w / width, bucket_h / height)  # output px per input px
    if scale > 1:
        return None
    if bucket_w * height >= bucket_h * width:  # the width binds: keep it whole (exact, no rounding)
        crop_w, crop_h = float(width), bucket_h * width / bucket_w
    else:
        crop_w, crop_h = bucket_w * height / bucket_h, float(height)
    left, top = (width - crop_w) / 2, (height - crop_h) / 2
    return (left, top, left + crop_w, top + crop_h)


def kept_fraction(width: int, height: int, bucket: Bucket) -> float:
    """Share of the image's pixels the cover crop keeps (1.0: nothing cut)."""
    box = cover_box(width, height, bucket) or (0, 0, width, height)
    return (box[2] - box[0]) * (box[3] - box[1]) / (width * height)


def cropped_shares(sizes: Iterable[tuple[int, int]], buckets: Sequence[Bucket]) -> tuple[float, float, int]:
    """(mean share of each picture a centre square crop cuts, the same with `buckets`, pictures counted) over
    (width, height) sizes; only pictures both ways keep (never upscaled) count, so the two compare alike."""
    square = max(buckets, key=lambda b: (b[0] == b[1], b[0] * b[1]))
    centre, bucketed, n = 0.0, 0.0, 0
    for width, height in sizes:
        bucket = nearest_bucket(width, height, buckets)
        if min(width, height) < square[0] or cover_box(width, height, bucket) is None:
            continue
        centre += 1 - min(width, height) ** 2 / (width * height)
        bucketed += 1 - kept_fraction(width, height, bucket)
        n += 1
    return (centre / n, bucketed / n, n) if n else (0.0, 0.0, 0)
