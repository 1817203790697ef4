"""Build the networks a preset names: VAE, tokenizer + text tower (two backends), U-Net.

The text embedding SD2 conditions on is OpenCLIP ViT-H/14's penultimate layer followed by its final
LayerNorm. Two backends produce it from the same weights:
- `transformers`: diffusers' converted `CLIPTextModel` (the last block already dropped, so its
  `last_hidden_state` is that embedding); what a diffusers folder such as stabilityai/stable-diffusion-2-base
  ships.
- `open_clip`: the original OpenCLIP text tower, run to its penultimate block and normalised with `ln_final`;
  for users who hold an OpenCLIP checkpoint.
`openclip_to_transformers` converts between them; a test checks both give the same embeddings.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from shared.presets import Preset

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

TextBackend = Literal["transformers", "open_clip"]
# CLIP's BPE keeps the first 49152 - 256 - 2 merges of its vocab file (as OpenCLIP's SimpleTokenizer does).
CLIP_BPE_MERGES = 49152 - 256 - 2


def weights_fingerprint(module: torch.nn.Module) -> str:
    """sha256 over parameter names, dtypes, shapes and bytes: the encoder's identity in fingerprints."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _seeded(seed: int) -> Any:
    """A context that forks the global RNG so random init is reproducible and leaves callers' RNG alone."""
    import torch

    ctx = torch.random.fork_rng(devices=[])
    ctx.__enter__()
    torch.manual_seed(seed)
    return ctx


# ------------------------------------------------------------------------------------- pretrained loads
def load_pretrained(cls: Any, source: str, subfolder: str) -> Any:
    """`cls.from_pretrained(source, subfolder=...)` for a diffusers folder or a hub id. A path that is no
    folder (a typo in encoder.pretrained / model.init_from) is refused before anything contacts the hub,
    and a load that fails is one line naming the source and the fix, not the hub client's traceback."""
    from shared.config import ConfigError

    local = Path(source).expanduser()
    looks_local = source.startswith(("/", ".", "~")) or source.count("/") > 1
    if looks_local and not local.is_dir():
        raise ConfigError(
            f"{source} is not a folder: pass a diffusers-format folder (with {subfolder}/ in it) or a hub id "
            "such as stabilityai/stable-diffusion-2-base"
        )
    try:
        return cls.from_pretrained(str(local) if looks_local else source, subfolder=subfolder)
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"cannot load {subfolder} from {source} ({first}); without network, download the model first "
            "(`huggingface-cli download stabilityai/stable-diffusion-2-base --local-dir /models/sd2`) and "
            "pass that folder"
        ) from None


# --------------------------------------------------------------------------------------------------- VAE
def build_vae(preset: Preset, pretrained: str | None = None) -> AutoencoderKL:
    """The preset's VAE in eval mode: from `pretrained` (folder or hub id) or random-init tiny weights."""
    from diffusers import AutoencoderKL

    source = pretrained or preset.pretrained
    if source:
        vae = load_pretrained(AutoencoderKL, source, "vae")
    else:
        ctx = _seeded(preset.seed)
        try:
            vae = AutoencoderKL(**preset.vae)
        finally:
            ctx.__exit__(None, None, None)
        if preset.vae_weights:
            from safetensors.torch import load_file

            vae.load_state_dict(load_file(preset.vae_weights))
    return vae.eval().requires_grad_(False)


# -------------------------------------------------------------------------------------------- tokenizer
@functools.lru_cache(maxsize=1)
def write_clip_tokenizer(out: Path) -> Path:
    """Write HF CLIPTokenizer files into `out`, built from the BPE vocab inside open_clip (works offline).

    Same vocab, merges and special ids as OpenCLIP's tokenizer and SD2's `tokenizer/` folder; padding with
    "!" (id 0) like SD2's, which matches OpenCLIP's zero padding.
    """
    import open_clip.tokenizer as oct

    with gzip.open(oct.default_bpe()) as handle:
        lines = handle.read().decode("utf-8").split("\n")
    merges = lines[1 : CLIP_BPE_MERGES + 1]
    byte_vocab = list(oct.bytes_to_unicode().values())
    vocab = byte_vocab + [v + "</w>" for v in byte_vocab] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps({tok: i for i, tok in enumerate(vocab)}))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "model_max_length": 77,
                "bos_token": "<|startoftext|>",
                "eos_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "!",
                "do_lower_case": True,
            }
        )
    )
    return out


def build_tokenizer(preset: Preset, pretrained: str | None = None) -> CLIPTokenizer:
    from transformers import CLIPTokenizer

    source = pretrained or preset.pretrained
    if source:
        return load_pretrained(CLIPTokenizer, source, "tokenizer")
    # The tokenizer reads its files once at construction; the folder is gone when this returns, so no
    # process leaves a clip-tokenizer folder behind in the shared temp dir.
    with tempfile.TemporaryDirectory(prefix="clip-tokenizer-") as tmp:
        return CLIPTokenizer.from_pretrained(str(write_clip_tokenizer(Path(tmp))))


# ----------------------------------------------------------------------------------------- text towers
class TextEncoder:
    """Captions -> [batch, context_length, width] float32 embeddings (penultimate layer + final LN).

    `encode` = `embed_tokens(tokenize(...))`; text.store=tokens stores `tokenize`'s ids and train runs
    `embed_tokens` in the step (under no_grad there: inference tensors cannot enter the U-Net's autograd).
    """

    backend: str
    model: torch.nn.Module

    def tokenize(self, captions: list[str]) -> torch.Tensor:
        """[batch, context_length] int64 token ids, padded and truncated to the context length."""
        raise NotImplementedError

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (on the tower's device) -> embeddings; runs in whatever grad mode the caller set."""
        raise NotImplementedError

    def encode(self, captions: list[str]) -> torch.Tensor:
        """Embeddings on the tower's device; on CUDA the ids cross from page-locked memory, so the call
        queues work without waiting for the device (a pageable copy would wait for everything queued)."""
        import torch

        ids, device = self.tokenize(captions), self.device
        if device.type == "cuda":
            ids = ids.pin_memory()
        with torch.inference_mode():
            return self.embed_tokens(ids.to(device, non_blocking=True)).float()

    def to(self, device: Any, dtype: Any = None) -> TextEncoder:
        self.model.to(device=device, dtype=dtype)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def fingerprint(self) -> str:
        return f"{self.backend}:{weights_fingerprint(self.model)}"


class TransformersTextEncoder(TextEncoder):
    backend = "transformers"

    def __init__(self, model: CLIPTextModel, tokenizer: CLIPTokenizer):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer

    def tokenize(self, captions: list[str]) -> torch.Tensor:
        length = self.model.config.max_position_embeddings
        return self.tokenizer(
            captions, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
        ).input_ids

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).last_hidden_state


class OpenClipTextEncoder(TextEncoder):
    backend = "open_clip"

    def __init__(self, tower: torch.nn.Module, context_length: int):
        import open_clip

        self.model = tower.eval().requires_grad_(False)
        self.context_length = context_length
        self.tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=context_length)

    def tokenize(self, captions: list[str]) -> torch.Tensor:
        return self.tokenizer(captions, context_length=self.context_length)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        penultimate = len(self.model.transformer.resblocks) - 2
        out = self.model.forward_intermediates(
            ids,
            indices=[penultimate],
            stop_early=True,
            normalize_intermediates=True,
            intermediates_only=True,
            output_fmt="NLC",
        )
        return out["text_intermediates"][0]


def build_open_clip_tower(preset: Preset, checkpoint: str | None = None) -> torch.nn.Module:
    """OpenCLIP text tower with the preset's shape; weights from a checkpoint or seeded random init."""
    import torch
    from open_clip.transformer import TextTransformer

    ctx = _seeded(preset.seed + 1)
    try:
        tower = TextTransformer(output_dim=preset.text_width, **preset.text)
        tower.init_parameters()
    finally:
        ctx.__exit__(None, None, None)
    if checkpoint:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state)
        tower_keys = set(tower.state_dict())
        # A full OpenCLIP CLIP checkpoint keeps the text tower's weights at the top level.
        picked = {k.removeprefix("module."): v for k, v in state.items()}
        picked = {k: v for k, v in picked.items() if k in tower_keys}
        missing = tower_keys - set(picked) - {"attn_mask"}
        if missing:
            raise ValueError(
                f"{checkpoint} is not an OpenCLIP checkpoint for this tower; missing {sorted(missing)[:5]}"
            )
        tower.load_state_dict(picked, strict=False)
    return tower


def clip_text_config(preset: Preset, layers: int) -> Any:
    """transformers' CLIPTextConfig of the preset's text tower (OpenCLIP's shapes) with `layers` blocks."""
    from transformers import CLIPTextConfig

    text = preset.text
    return CLIPTextConfig(
        vocab_size=text["vocab_size"],
        hidden_size=text["width"],
        intermediate_size=4 * text["width"],
        num_hidden_layers=layers,
        num_attention_heads=text["heads"],
        max_position_embeddings=text["context_length"],
        hidden_act="gelu",
        projection_dim=text["width"],
        pad_token_id=1,
    )


def openclip_to_transformers(tower: torch.nn.Module, preset: Preset) -> CLIPTextModel:
    """Convert an OpenCLIP text tower to diffusers' CLIPTextModel layout, dropping the last block."""
    from transformers import CLIPTextModel

    layers = preset.text["layers"] - 1
    config = clip_text_config(preset, layers)
    ctx = _seeded(preset.seed)  # its random init is overwritten below; don't advance the caller's RNG
    try:
        model = CLIPTextModel(config)
    finally:
        ctx.__exit__(None, None, None)
    src = tower.state_dict()
    state = {
        "text_model.embeddings.token_embedding.weight": src["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": src["positional_embedding"],
        "text_model.final_layer_norm.weight": src["ln_final.weight"],
        "text_model.final_layer_norm.bias": src["ln_final.bias"],
    }
    for i in range(layers):
        s, d = f"transformer.resblocks.{i}.", f"text_model.encoder.layers.{i}."
        for proj, w, b in zip(
            ("q_proj", "k_proj", "v_proj"),
            src[s + "attn.in_proj_weight"].chunk(3),
            src[s + "attn.in_proj_bias"].chunk(3),
            strict=True,
        ):
            state[f"{d}self_attn.{proj}.weight"], state[f"{d}self_attn.{proj}.bias"] = w, b
        pairs = {
            "attn.out_proj": "self_attn.out_proj",
            "ln_1": "layer_norm1",
            "ln_2": "layer_norm2",
            "mlp.c_fc": "mlp.fc1",
            "mlp.c_proj": "mlp.fc2",
        }
        for a, b_ in pairs.items():
            state[f"{d}{b_}.weight"] = src[f"{s}{a}.weight"]
            state[f"{d}{b_}.bias"] = src[f"{s}{a}.bias"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(f"conversion left missing={missing} unexpected={unexpected}")
    return model.eval()


class TextLayerError(ValueError):
    """A text encoder would not give the embedding SD2 conditions on; the message names the fix."""


def penultimate_layer_count(preset: Preset) -> int:
    """Blocks a converted CLIPTextModel keeps: the tower's minus its last (SD2-base: 24 -> 23)."""
    return int(preset.text["layers"]) - 1


def check_penultimate_layer(model: CLIPTextModel, preset: Preset, source: str) -> None:
    """Refuse a CLIPTextModel whose last_hidden_state is not the penultimate layer + final LayerNorm.

    diffusers' converted SD2 text_encoder has the last block dropped, so its last_hidden_state is the
    SD2 embedding. A full tower (e.g. 24 layers for ViT-H/14) would silently give the last layer's output.
    """
    found, expected = int(model.config.num_hidden_layers), penultimate_layer_count(preset)
    if found == expected:
        return
    full = " (the full tower: its last_hidden_state is the LAST layer, not the penultimate one)"
    raise TextLayerError(
        f"{source}/text_encoder has {found} layers but preset {preset.name} expects {expected}"
        f"{full if found == expected + 1 else ''}; SD2 conditions on the penultimate layer + final "
        f"LayerNorm. Use a diffusers folder whose text_encoder has {expected} layers (as "
        "stabilityai/stable-diffusion-2-base ships it), or encoder.text_backend=open_clip with "
        "encoder.open_clip_checkpoint, or the preset matching this text encoder"
    )


def build_text_encoder(
    preset: Preset,
    backend: TextBackend = "transformers",
    pretrained: str | None = None,
    open_clip_checkpoint: str | None = None,
) -> TextEncoder:
    """The preset's text tower behind the chosen backend."""
    source = pretrained or preset.pretrained
    if backend == "open_clip":
        if preset.pretrained and not open_clip_checkpoint:
            raise ValueError(
                f"encoder.text_backend=open_clip with preset {preset.name} needs "
                "encoder.open_clip_checkpoint (e.g. ViT-H-14 laion2b_s32b_b79k's open_clip_pytorch_model.bin)"
            )
        tower = build_open_clip_tower(preset, open_clip_checkpoint)
        return OpenClipTextEncoder(tower, preset.text_length)
    if source:
        from transformers import CLIPTextModel

        model = load_pretrained(CLIPTextModel, source, "text_encoder")
        check_penultimate_layer(model, preset, source)
    else:
        model = openclip_to_transformers(build_open_clip_tower(preset), preset)
    return TransformersTextEncoder(model, build_tokenizer(preset, pretrained))


# ------------------------------------------------------------------------------------------------ U-Net
def build_unet(preset: Preset, pretrained: str | None = None) -> UNet2DConditionModel:
    """Random-init U-Net with the preset's shapes (pretraining), or loaded from a diffusers folder."""
    from diffusers import UNet2DConditionModel

    if pretrained:
        return load_pretrained(UNet2DConditionModel, pretrained, "unet")
    ctx = _seeded(preset.seed + 2)
    try:
        return UNet2DConditionModel(**preset.unet)
    finally:
        ctx.__exit__(None, None, None)
