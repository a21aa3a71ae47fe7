"""The tiny text stack: a byte-level Qwen2 tokenizer, a random Qwen3-VL text encoder deep enough for the layer the
pipeline reads, and a Qwen3-VL processor assembled without torchvision."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from h3serve.tools.tiny.presets import (
    EOS_TOKEN,
    PROCESSOR_MEAN_STD,
    PROCESSOR_SIZE,
    TEXT_HIDDEN,
    TEXT_LAYERS,
    VISION_TOKENS,
)
from h3serve.tools.tiny.random_init import construct, randomize_

if TYPE_CHECKING:
    from torch import Generator, nn
    from transformers import Qwen2TokenizerFast, Qwen3VLProcessor


def _byte_symbols() -> list[str]:
    """The 256 byte-level BPE symbols (GPT-2 convention): printable bytes map to themselves, the rest above 255."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def build_tokenizer() -> Qwen2TokenizerFast:
    """A merge-free byte-level Qwen2 tokenizer: one token per UTF-8 byte, plus the Qwen-VL special tokens."""
    from transformers import Qwen2TokenizerFast

    vocab = {symbol: index for index, symbol in enumerate(_byte_symbols())}
    vocab[EOS_TOKEN] = len(vocab)
    return Qwen2TokenizerFast(vocab=vocab, merges=[], additional_special_tokens=list(VISION_TOKENS))


def build_text_encoder(tokenizer: Qwen2TokenizerFast, generator: Generator) -> nn.Module:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    start_id, end_id, image_id, video_id = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": TEXT_LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,  # text-encoder TP2 splits both the query and the KV heads
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": TEXT_HIDDEN,
        "num_position_embeddings": 256,
        "deepstack_visual_indexes": [0],
    }
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        vision_start_token_id=start_id,
        vision_end_token_id=end_id,
        image_token_id=image_id,
        video_token_id=video_id,
        tie_word_embeddings=False,
    )
    model = construct(Qwen3VLForConditionalGeneration, config)
    randomize_(model, generator)
    return model.eval()


def build_processor(tokenizer: Qwen2TokenizerFast) -> Qwen3VLProcessor:
    from transformers import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    shared = {
        "patch_size": 16,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "image_mean": list(PROCESSOR_MEAN_STD),
        "image_std": list(PROCESSOR_MEAN_STD),
    }
    image_processor = Qwen2VLImageProcessorPil(size=dict(PROCESSOR_SIZE), **shared)
    video_processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": 4 * 1024, "longest_edge": 64 * 1024}, max_video_tokens=16, **shared
    )
    return make_processor(image_processor, tokenizer, video_processor)


def _skip_video_processor_class_check() -> contextlib.AbstractContextManager[Any]:
    """Let ``Qwen3VLProcessor`` accept a video processor while torchvision (and so its class registry) is missing."""
    from unittest import mock

    from transformers import Qwen3VLProcessor

    base_check = Qwen3VLProcessor.check_argument_for_proper_class

    def check(self: Any, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor":
            return type(argument)
        return base_check(self, argument_name, argument)

    return mock.patch.object(Qwen3VLProcessor, "check_argument_for_proper_class", check)


def make_processor(image_processor: Any, tokenizer: Any, video_processor: Any) -> Qwen3VLProcessor:
    from transformers import Qwen3VLProcessor

    with _skip_video_processor_class_check():
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)
