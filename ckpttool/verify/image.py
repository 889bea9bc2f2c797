"""The image input of ``verify`` for a vision-language model: a small synthetic image and a prompt holding its image
tokens, so that the forward runs through the vision tower and its projector or merger, not only the language model.

The image goes through the model's own image processor when it can be built from the checkpoint's processor files
(``preprocessor_config.json``, copied by merge; never from the hub, never remote code). transformers' image
processors need PIL or torchvision; where neither is installed, or the checkpoint has no processor files, the
pixels are laid out from the config as the processor would lay them out, for the families whose layout is known:

- Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense, MoE): flattened patches ``[patches, 3 * temporal * patch * patch]`` of a
  grid ``(1, 2m, 2m)`` (``m`` the spatial merge size), ``image_grid_thw``, and ``4`` image tokens after the merge;
- Gemma 3: one ``image_size`` square image ``[1, 3, size, size]`` and ``mm_tokens_per_image`` image tokens between
  its begin- and end-of-image tokens.

Any other vision-language model is verified on text only (a note says so). The image is fixed (seeded), the same
for the output and the reference.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: the seed of the synthetic image; its side in pixels when the processor takes any size
SEED, SIDE = 0, 32
_QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


@dataclass(frozen=True, slots=True)
class ImageInput:
    """The keyword inputs of one forward with an image (``input_ids``, ``pixel_values``, ...), how they were
    made, in words (for the report), and the image token's id."""

    inputs: dict[str, torch.Tensor]
    source: str
    image_token: int


def image_input(path: Path, config: dict[str, Any]) -> ImageInput | str | None:
    """The image input for the vision-language model in ``path`` (``config``: its config), a note saying why it is
    verified on text only, or None when it is no vision-language model (its config has no ``vision_config``)."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return None
    model_type = config.get("model_type")
    if model_type not in (*_QWEN, "gemma3"):
        return f"{model_type} is verified on text only: ckpttool does not know how its images are laid out"
    try:
        if model_type in _QWEN:
            return _qwen(path, config, vision)
        return _gemma3(path, config, vision)
    except (KeyError, TypeError, ValueError) as e:  # a config without the sizes its family needs
        return f"{model_type} is verified on text only: its config does not give the image layout ({e})"


def with_token_types(model: torch.nn.Module, image: ImageInput) -> dict[str, torch.Tensor]:
    """``image``'s inputs, with the ``mm_token_type_ids`` (1 at image tokens) a model that takes them needs
    (Qwen3-VL computes its multimodal RoPE from them)."""
    inputs = dict(image.inputs)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == image.image_token).int()
    return inputs


def _pixels(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(SEED))


def _processor(path: Path):
    """The checkpoint's image processor, or the reason there is none (a string)."""
    if not (path / "preprocessor_config.json").is_file():
        return "no preprocessor_config.json"
    try:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (ImportError, OSError, ValueError) as e:  # no PIL / torchvision here, or files it cannot use
        return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _image(side: int) -> torch.Tensor:
    """A fixed RGB image, ``[3, side, side]`` uint8."""
    return (_pixels((3, side, side)) * 255).to(torch.uint8)


def _qwen(path: Path, config: dict[str, Any], vision: dict[str, Any]) -> ImageInput:
    patch, merge, temporal = int(vision["patch_size"]), int(vision["spatial_merge_size"]), int(
        vision["temporal_patch_size"])
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    image_token = int(config.get("image_token_id", text.get("image_token_id", -1)))
    start = int(config.get("vision_start_token_id", text.get("vision_start_token_id", -1)))
    end = int(config.get("vision_end_token_id", text.get("vision_end_token_id", -1)))
    processor = _processor(path)
    if isinstance(processor, str):
        side = 2 * merge
        grid = torch.tensor([[1, side, side]])
        pixels = _pixels((side * side, 3 * temporal * patch * patch)) * 2 - 1
        how = (f"a synthetic {side * patch}x{side * patch} image laid out from the config (no image processor: "
               f"{processor})")
    else:
        done = processor(images=[_image(2 * merge * patch)], return_tensors="pt")
        pixels, grid = done["pixel_values"], done["image_grid_thw"]
        how = f"a synthetic {2 * merge * patch}x{2 * merge * patch} image through {type(processor).__name__}"
    tokens = int(grid.prod()) // (merge * merge)
    ids = torch.tensor([[start, *[image_token] * tokens, end, *_TEXT]])
    return ImageInput(dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid), f"{how}, {tokens} image tokens",
                      image_token)


def _gemma3(path: Path, config: dict[str, Any], vision: dict[str, Any]) -> ImageInput:
    size, tokens = int(vision["image_size"]), int(config["mm_tokens_per_image"])
    image_token, start, end = (int(config[k]) for k in ("image_token_index", "boi_token_index", "eoi_token_index"))
    processor = _processor(path)
    if isinstance(processor, str):
        pixels = _pixels((1, 3, size, size)) * 2 - 1
        how = f"a synthetic {size}x{size} image laid out from the config (no image processor: {processor})"
    else:
        pixels = processor(images=[_image(size)], return_tensors="pt")["pixel_values"]
        how = f"a synthetic {size}x{size} image through {type(processor).__name__}"
    ids = torch.tensor([[start, *[image_token] * tokens, end, *_TEXT]])
    return ImageInput(dict(input_ids=ids, pixel_values=pixels), f"{how}, {tokens} image tokens", image_token)


#: text after the image: fixed ids low in every vocabulary
_TEXT = (5, 9, 17)
