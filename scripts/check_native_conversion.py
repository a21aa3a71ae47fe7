"""Independent check of the native tiny checkpoint: diffusers' own conversion script reads it, diffusers loads the
result, and the outputs match h3serve on the native tree (docs/checkpoints.md records a run).

    python scripts/check_native_conversion.py CONVERTER WORKDIR

CONVERTER is diffusers' `scripts/convert_minimax_h3_to_diffusers.py` (fetched from the diffusers repository; it is
not in the wheel and not vendored here). The script has no flag for a model's sizes: its tiny "test" constants
are set to the tiny checkpoint's sizes, its fp32 prefix list to every key (the tiny checkpoint is all float32)
and its hard-coded 32 kHz audio-VAE constants to the tiny ones; its conversion code runs unchanged. FL2VA is
converted whole (`main`), the Ref2VA DiT with the script's own `convert_transformer`; the native block's canvas
settings, which the script does not carry, are written into the converted pipeline config. T2VA, FL2VA and Ref2VA
(one reference image) are then compared, their inputs built as the suite's parity tests build them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from h3serve.checkpoint.resolver import read_json, read_layout
from h3serve.loading.components import load_components
from h3serve.model.conditioning import normalize_image_reference, prepare_keyframes
from h3serve.model.pipeline import H3Pipeline
from h3serve.model.pipeline_types import Conditioning
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import GenerationPlan, validate
from h3serve.tools.bench.peer import load_reference_pipeline, reference_inputs
from h3serve.tools.tiny.make_native import build_native_checkpoint

PROMPT = "A red fox trots through fresh snow at dawn."
CANVAS_KEYS = ("canvas_short_edge", "canvas_max_pixels", "reference_image_short_edge")


def _converter(path: Path):
    spec = importlib.util.spec_from_file_location("convert_minimax_h3_to_diffusers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def convert(converter: Path, native: Path, out: Path) -> None:
    conv = _converter(converter)
    layout = read_layout(native)
    dit = {k: v for k, v in layout.component_config("transformer").items() if not k.startswith("_")}
    vae = {k: v for k, v in layout.component_config("vae").items() if k not in ("latents_mean", "latents_std")}
    audio = layout.component_config("audio_vae")
    conv.MINIMAX_H3_TEST_TRANSFORMER_CONFIG = {**dit, "patch_size": list(dit["patch_size"])}
    conv.MINIMAX_H3_TEST_VIDEO_VAE_CONFIG = vae
    conv.MINIMAX_H3_FP32_SOURCE_PREFIXES = ("",)
    conv.MINIMAX_H3_AUDIO_VAE_FIXED_CONFIG = {
        k: audio[k] for k in ("num_attention_heads", "resblock_kernel_sizes", "resblock_dilation_sizes")
    }
    args = argparse.Namespace(
        checkpoint_path=str(native / "FL2VA"),
        output_path=str(out),
        modular_repo_id=None,
        version="test",
        max_shard_size=5 * 1024**3,
        dry_run=False,
    )
    conv.main(args)
    ref_out = out / "transformer_ref"
    conv.convert_transformer(str(native / "Ref2VA"), str(ref_out), conv.MINIMAX_H3_TEST_TRANSFORMER_CONFIG, 5 << 30)
    conv.write_transformer_config(str(ref_out), conv.MINIMAX_H3_TEST_TRANSFORMER_CONFIG, "0.42.1")
    for name in ("text_encoder", "tokenizer", "processor"):  # the script converts neither: same format in both
        shutil.copytree(native / "FL2VA" / name, out / name)
    carry_canvas(native, out)


def carry_canvas(native: Path, out: Path) -> None:
    """The canvas settings of the native `_minimax_h3` block into the converted pipeline config.

    The script writes none (diffusers then uses the release's: short edge 768, 1,032,192 pixels, reference images
    at 2048); the tiny checkpoint's are smaller, and a Ref2VA reference image is scaled by them."""
    block = read_json(native / "FL2VA" / "model_index.json")["_minimax_h3"]
    index_path = out / "modular_model_index.json"
    index = read_json(index_path)
    index.update({key: block[key] for key in CANVAS_KEYS})
    index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def compare_weights(native: Path, converted: Path) -> int:
    """Every converted tensor against h3serve's in-place read of the native tree: bit for bit."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

    ours = load_components(read_layout(native))
    loaders = {
        "transformer": MiniMaxH3Transformer3DModel,
        "transformer_ref": MiniMaxH3Transformer3DModel,
        "vae": AutoencoderKLMiniMaxH3,
        "audio_vae": AutoencoderKLMiniMaxH3Audio,
    }
    count = 0
    for name, cls in loaders.items():
        theirs = cls.from_pretrained(converted / name).state_dict()
        mine = getattr(ours, name).state_dict()
        if mine.keys() != theirs.keys():
            raise SystemExit(f"{name}: key sets differ: {sorted(set(mine) ^ set(theirs))[:5]}")
        unequal = [k for k, v in theirs.items() if not torch.equal(v, mine[k])]
        print(f"{name}: {len(theirs)} tensors, {len(unequal)} differ" + (f" ({unequal[:3]})" if unequal else ""))
        count += len(unequal)
    return count


def _case(task: str, image: Image.Image, defaults) -> tuple[GenerationPlan, Conditioning, dict]:
    """One task's plan, h3serve's conditioning and the images diffusers gets, as the suite's parity tests build
    them (tests/model/test_workflow_parity.py): the keyframe on the canvas, the reference at its short edge."""
    base = dict(prompt=PROMPT, duration_s=5, steps=3, seed=0)  # the suite's T2VA parity case
    if task == "fl2va":
        plan = validate(GenerationRequest(**base, image=_ref("keyframe.png")), defaults, keyframe_size=image.size)
        keyframes = prepare_keyframes([image], plan.width, plan.height)
        return plan, Conditioning(keyframes=keyframes, anchors=plan.anchors), {"image": image}
    if task == "ref2va":
        plan = validate(GenerationRequest(**base, references=(_ref("reference.png"),)), defaults)
        refs = [normalize_image_reference(image, defaults.reference_image_short_edge)]
        return plan, Conditioning(references=refs), {"image_0": image}
    return validate(GenerationRequest(**base), defaults), Conditioning(), {}


def _ref(name: str) -> MediaRef:
    return MediaRef(path=f"/dev/null/{name}", name=name, kind="image")


def compare(native: Path, converted: Path) -> float:
    """h3serve's pipeline on the native tree against diffusers 0.42.1 on the converted one, per task."""
    layout = read_layout(native)
    pipeline = H3Pipeline(load_components(layout))
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (256, 384, 3), dtype=np.uint8))
    worst = 0.0
    for task in ("t2va", "fl2va", "ref2va"):
        plan, cond, images = _case(task, image, layout.defaults())
        ours = pipeline.generate(plan, cond)
        ref = load_reference_pipeline(converted, task)(**reference_inputs(plan, images))
        video = (ours.video - torch.from_numpy(np.asarray(ref.get("videos")[0]))).abs().max().item()
        audio = (ours.audio - torch.as_tensor(np.asarray(ref.get("audio")[0]))).abs().max().item()
        same = torch.equal(ours.video_latents, ref.get("latents")) and torch.equal(
            ours.audio_latents, ref.get("audio_latents")
        )
        print(
            f"{task}: {plan.num_frames} frames {plan.width}x{plan.height}, {plan.steps} forwards: latents "
            f"{'bit-identical' if same else 'differ'}, max |video diff| {video:.3g}, max |audio diff| {audio:.3g} "
            f"(video std {ours.video.std():.3g})"
        )
        worst = max(worst, video, audio)
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("converter", type=Path)
    parser.add_argument("workdir", type=Path)
    args = parser.parse_args()
    native = args.workdir / "native"
    if not native.exists():
        build_native_checkpoint(native, seed=0)
    if not (args.workdir / "converted").exists():
        convert(args.converter, native, args.workdir / "converted")
    worst = compare(native, args.workdir / "converted")
    unequal = compare_weights(native, args.workdir / "converted")
    ok = worst <= 1e-5 and unequal == 0
    verdict = "PASS" if ok else "FAIL"
    print(f"weights: {unequal} tensors differ; worst output difference {worst:.3g} (limit 1e-5): {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
