"""The pipeline's first stage: the presentation (text with its vision blocks), the text states, the condition
latents and the packed layout, for T2VA / FL2VA keyframes and for Ref2VA references."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
from PIL import Image

from h3serve.model.conditioning import (
    ImageReference,
    Presentation,
    Reference,
    VideoReference,
    encode_audio_condition,
    encode_visual_condition,
    image_pixels,
    reference_audio,
    reference_kind,
    sample_condition_frames,
    video_condition_pixels,
)
from h3serve.model.layout import ReferenceBlock, build_keyframe_layout, build_reference_layout
from h3serve.model.pipeline_types import Encoded, H3Components, LatentGuide, LatentTarget, ReferenceMedia, StageClock
from h3serve.model.text_encoder import IMAGE_PAD, VIDEO_PAD
from h3serve.model.vision_inputs import num_vision_tokens, preprocess_image, preprocess_video
from h3serve.rules import limits
from h3serve.rules.validate import GenerationPlan

VideoBlocks = list[tuple[int, list[float]]]  # (tokens per block, block timestamps) per video reference


def encode_text(
    components: H3Components, ids: list[int], vision: dict[str, torch.Tensor], clock: StageClock | None = None
) -> torch.Tensor:
    """A presentation's text states: from the prompt cache when it holds them (no `text_encode` stage: the encoder
    is neither run nor placed), else through the encoder (timed as `text_encode`) and kept in the cache."""
    key = components.text.prompt_key(ids, vision)
    states = components.text.cached(key)
    if states is not None:
        return states
    with clock("text_encode") if clock is not None else nullcontext():
        return components.text.encode(ids, vision, key)


def image_inputs(components: H3Components, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    per_image = [preprocess_image(img, components.vision_config) for img in images]
    return {
        "pixel_values": torch.cat([p["pixel_values"] for p in per_image]),
        "image_grid_thw": torch.cat([p["image_grid_thw"] for p in per_image]),
    }


def keyframes_encoded(
    components: H3Components,
    device: torch.device,
    plan: GenerationPlan,
    keyframes: list[Image.Image],
    anchors: tuple[str, ...],
    clock: StageClock,
) -> Encoded:
    """T2VA (no keyframes) and FL2VA: "<Picture k>: " + vision block per keyframe, then the prompt."""
    text = Presentation(components.text.tokenizer)
    vision: dict[str, torch.Tensor] = {}
    visual: list[torch.Tensor] = []
    if keyframes:
        with clock("vision_encode"):
            vision = image_inputs(components, keyframes)
        for k, grid in enumerate(vision["image_grid_thw"]):
            text.text(f"<Picture {k + 1}>: ")
            text.vision(IMAGE_PAD, num_vision_tokens(grid, components.vision_config.merge_size))
        with clock("vae_encode"):
            visual = [encode_visual_condition(components.vae, image_pixels(k).to(device)) for k in keyframes]
    text.text(plan.prompt)
    text_states = encode_text(components, text.ids, vision, clock)
    layout = build_keyframe_layout(
        torch.tensor(text.tags),
        plan.latent_frames,
        plan.latent_height,
        plan.latent_width,
        plan.audio_latents,
        anchors,
    )
    return Encoded(text.ids, text_states, layout, visual, [])


def _reference_vision(components: H3Components, refs: list[Reference]) -> tuple[dict[str, torch.Tensor], VideoBlocks]:
    """The Qwen3-VL inputs of the image and video references, and each video's vision blocks."""
    merge = components.vision_config.merge_size
    images = [r.image for r in refs if isinstance(r, ImageReference)]
    vision = image_inputs(components, images) if images else {}
    video_blocks: VideoBlocks = []
    video_inputs = []
    for r in refs:
        if isinstance(r, VideoReference):
            frames, stamps = sample_condition_frames(r.frames)
            inputs = preprocess_video(np.stack(frames), components.vision_config)
            grid = inputs["video_grid_thw"][0]
            video_blocks.append((int(grid[1]) * int(grid[2]) // merge**2, stamps))
            video_inputs.append(inputs)
    if video_inputs:
        vision["pixel_values_videos"] = torch.cat([v["pixel_values_videos"] for v in video_inputs])
        vision["video_grid_thw"] = torch.cat([v["video_grid_thw"] for v in video_inputs])
    return vision, video_blocks


def _reference_labels(
    components: H3Components, refs: list[Reference], vision: dict[str, torch.Tensor], video_blocks: VideoBlocks
) -> Presentation:
    """Labels numbered per modality (a soundtrack's label before its video's), each with its vision blocks."""
    merge = components.vision_config.merge_size
    text = Presentation(components.text.tokenizer)
    counts = {"image": 0, "video": 0, "audio": 0}
    for r in refs:
        if reference_audio(r) is not None:
            counts["audio"] += 1
            text.text(f"<Audio {counts['audio']}>: ")
        if isinstance(r, ImageReference):
            counts["image"] += 1
            text.text(f"<Picture {counts['image']}>: ")
            text.vision(IMAGE_PAD, num_vision_tokens(vision["image_grid_thw"][counts["image"] - 1], merge))
        elif isinstance(r, VideoReference):
            counts["video"] += 1
            text.text(f"<Video {counts['video']}>: ")
            tokens, stamps = video_blocks[counts["video"] - 1]
            for stamp in stamps:
                text.text(f"<{stamp:.1f} seconds>")
                text.vision(VIDEO_PAD, tokens)
    return text


def reference_media(
    components: H3Components, device: torch.device, refs: list[Reference], clock: StageClock
) -> ReferenceMedia:
    """Ref2VA references encoded once per request: labels, vision inputs, condition latents and layout blocks."""
    with clock("vision_encode"):
        vision, video_blocks = _reference_vision(components, refs)
    text = _reference_labels(components, refs, vision, video_blocks)
    visual, audio_rows, blocks = [], [], []
    with clock("vae_encode"):
        for r in refs:
            kind, audio_latents = reference_kind(r), 0
            wave = reference_audio(r)
            if wave is not None:
                audio_rows.append(encode_audio_condition(components.audio_vae, wave))
                audio_latents = audio_rows[-1].shape[0] // limits.AUDIO_CHANNELS
            if kind == "audio":
                blocks.append(ReferenceBlock(kind, audio_latents=audio_latents))
                continue
            pixels = image_pixels(r.image) if kind == "image" else video_condition_pixels(r.frames)
            visual.append(encode_visual_condition(components.vae, pixels, device))
            f, h, w = visual[-1].shape[2:]
            blocks.append(ReferenceBlock(kind, f, h, w, audio_latents))
    return ReferenceMedia(text.ids, text.tags, vision, visual, audio_rows, blocks)


def presentation(components: H3Components, media: ReferenceMedia, prompt: str) -> Presentation:
    """The references' labels and vision blocks, then the prompt."""
    text = Presentation(components.text.tokenizer)
    text.ids, text.tags = list(media.ids), list(media.tags)
    text.text(prompt)
    return text


def reference_encoded(
    components: H3Components,
    media: ReferenceMedia,
    text: Presentation,
    target: LatentTarget,
    clock: StageClock,
    guide: tuple[ReferenceBlock, LatentGuide] | None = None,
    media_origin: float | None = None,
    time_offset: float = 0.0,
) -> Encoded:
    """Text states and the packed layout of references (and a continuation window's guide) before `target`."""
    text_states = encode_text(components, text.ids, media.vision, clock)
    blocks, visual, audio_rows = list(media.blocks), list(media.visual), list(media.audio_rows)
    if guide is not None:
        block, latents = guide
        blocks.append(block)
        visual.append(latents.video)
        audio_rows.append(latents.audio_rows())
    layout = build_reference_layout(
        torch.tensor(text.tags),
        blocks,
        target.latent_frames,
        target.latent_height,
        target.latent_width,
        target.audio_latents,
        media_origin=media_origin,
        time_offset=time_offset,
    )
    return Encoded(text.ids, text_states, layout, visual, audio_rows)
