"""The bundled sample dataset: synthetic but real image files in real img2dataset layouts.

Nothing can be downloaded, so `make demo` and the tests build their data here, deterministically (fixed
seeds, fixed tar headers: identical bytes on every machine with the pinned Pillow/pyarrow). Each image is
one coloured shape on a contrasting background, and its caption says so ("a red circle on a blue
background"), so a model trained on it can be checked: samples for different prompts must differ the way
their captions say (`color_of_caption` parses a caption back, `COLORS` gives the RGB values). The shape
always covers the image centre and the background always fills the corners, whatever the size, position
jitter or crop.

Modules: render (the samples and their captions), layouts (tars, parquet, folder). The hostile-input tar the
tests need is built in tests/builders/hostile.py.

    python -m encode sample-data --out DIR [--format webdataset|parquet|folder]
        -> DIR/webdataset (default: 4 x 128 samples), DIR/parquet or DIR/folder
"""

from __future__ import annotations

from encode.sample_data.layouts import (
    BUILDERS,
    build,
    build_image_folder,
    build_parquet,
    build_webdataset,
)
from encode.sample_data.render import (
    CAPTION_TEMPLATES,
    COLORS,
    SHAPES,
    SampleSpec,
    color_of_caption,
    encode_image,
    parse_caption,
    render,
    sample_captions,
)

__all__ = [
    "BUILDERS",
    "CAPTION_TEMPLATES",
    "COLORS",
    "SHAPES",
    "SampleSpec",
    "build",
    "build_image_folder",
    "build_parquet",
    "build_webdataset",
    "color_of_caption",
    "encode_image",
    "parse_caption",
    "render",
    "sample_captions",
]
