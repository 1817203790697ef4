"""Issue 22 (5): text.store=tokens gives the embeddings the stored path (text.store=embeddings) gives, even
though the train step runs under Composer's bf16 autocast: the tower runs in encode's precision instead.

Tolerance: on CPU (encode's tower runs fp32 there) the same bits. On a GPU both paths run the tower under
fp16 autocast and round to fp16; the gpu test allows one fp16 rounding step of the largest value (2**-10
relative), against bf16's 2**-7 that the step's autocast would have given.
"""

from __future__ import annotations

import pytest
import torch

from shared.models import build_text_encoder
from shared.presets import get_preset
from train.model.online_text import STORED_DTYPE, OnlineText

CAPTIONS = ["a photo of a cat", "an oil painting of a lighthouse at dusk", ""]
FP16_STEP = 2.0**-10  # fp16's relative rounding step: the stored path rounds to it anyway


def stored_and_online(
    device: torch.device, encode_autocast: torch.autocast | None
) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    text = build_text_encoder(get_preset("tiny"))
    text.to(device)
    ids = text.tokenize(CAPTIONS).to(device)
    with torch.no_grad(), encode_autocast or torch.autocast(device.type, enabled=False):
        stored = text.encode(CAPTIONS).float().to(STORED_DTYPE).float()  # what encode writes
    online = OnlineText(text, ids[-1], precision="fp16" if device.type == "cuda" else "fp32")
    step_dtype = torch.bfloat16
    with torch.autocast(device.type, dtype=step_dtype):  # Composer's amp_bf16 around the train step
        embedded = online.embed(ids, drop=torch.zeros(len(CAPTIONS), dtype=torch.bool, device=device))
        with torch.no_grad():
            in_step_autocast = text.embed_tokens(ids).to(STORED_DTYPE).float()  # the old behaviour
    return stored, embedded, in_step_autocast


def test_tokens_mode_under_bf16_autocast_matches_the_stored_embeddings_on_cpu() -> None:
    stored, embedded, in_step_autocast = stored_and_online(torch.device("cpu"), None)
    assert torch.equal(embedded, stored)
    # the positive control: the tower under the step's bf16 autocast moves the embeddings visibly
    scale = stored.abs().max()
    assert (in_step_autocast - stored).abs().max() > 4 * FP16_STEP * scale


@pytest.mark.gpu
def test_tokens_mode_under_bf16_autocast_matches_the_stored_embeddings_on_gpu() -> None:
    fp16 = torch.autocast("cuda", dtype=torch.float16)  # encode's encoder.precision=fp16
    stored, embedded, _ = stored_and_online(torch.device("cuda"), fp16)
    assert (embedded - stored).abs().max() <= FP16_STEP * stored.abs().max()
