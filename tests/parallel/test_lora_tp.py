"""LoRA under DiT tensor parallelism: each rank holds A or B cut like its layer's weight; the TP2 output equals
the single-process model the test merged with plain torch (W + s·alpha/r·B@A), and on FP8 base weights the TP2
output equals one-rank FP8 + LoRA (within 1e-5 of the output's range: only the reduction order differs). A FastH3
adapter fused at load under TP2 (fused in fp32 before the shard is cut) equals the one-rank fused DiT likewise, and
a PDD adapter (its AdaLN factors cut like the gathered AdaLN projection, its fused heads) equals the test's own
merge at one forward."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from rank_harness import run_ranks
from safetensors.torch import save_file
from small_dit import SMALL_DIT

from h3serve.config.quantization_config import ComponentQuant
from h3serve.loading.components import load_transformer
from h3serve.model.transformer import H3Transformer, H3TransformerConfig
from h3serve.parallel.tensor_parallel import Fp8RowParallelLinear
from h3serve.rules.adapter_choice import AdapterChoice
from h3serve.tools.tiny.make_adapter import write_fasth3_adapter, write_pdd_adapter, write_peft_adapter

SCALE, ALPHA, RANK = 0.8, 4.0, 4


def _inputs():
    from h3serve.model.layout import TEXT_TAG, build_keyframe_layout, patchify

    g = torch.Generator().manual_seed(1)
    frames, text_len, lh, lw = 5, 7, 2, 4
    layout = build_keyframe_layout(torch.full((text_len,), TEXT_TAG), frames, lh, lw, 3 * frames, anchors=("first",))
    video = patchify(torch.randn(1, 24, frames + 1, lh, lw, generator=g))[None]
    audio = torch.randn(1, 6 * frames, 32, generator=g)
    text = torch.randn(1, text_len, SMALL_DIT["text_dim"], generator=g)
    timestep, row_index = layout.row_timesteps(0.3, 0.6)
    return video, audio, text, timestep, row_index, layout.packed


def _run(model, inputs, step: int | None = None):
    video, audio, text, timestep, row_index, packed = inputs
    with torch.inference_mode():
        return model(video, audio, model.embed_text(text), timestep, row_index, packed, step=step)


PDD_STEP = 2  # the forward whose fused heads the PDD comparison runs


def _pdd_adapted(folder: str, pdd: str, tp=None) -> H3Transformer:
    from h3serve.adapters.header import read_header
    from h3serve.adapters.pdd import inspect_pdd
    from h3serve.rank.lora import LoraRuntime

    dit = load_transformer(folder, tp=tp)
    dit.fuse_projections()
    info = inspect_pdd(read_header(pdd), json.loads((Path(folder) / "config.json").read_text()))
    runtime = LoraRuntime({"transformer": dit}, slot_rank=8, tp=tp, adaln=True)
    choice = AdapterChoice("p", pdd, 1.0, 2, info.lora.rank, info.lora.alpha, pdd=info.contract)
    runtime.activate("transformer", choice)
    return dit


def _adapted(folder: str, adapter: str, tp=None, quant: ComponentQuant | None = None) -> H3Transformer:
    from h3serve.rank.lora import LoraRuntime

    dit = load_transformer(folder, tp=tp, quant=quant)
    dit.fuse_projections()
    runtime = LoraRuntime({"transformer": dit}, slot_rank=8, tp=tp)
    runtime.activate("transformer", AdapterChoice("a", adapter, SCALE, 1, RANK, ALPHA))
    return dit


def _tp_rank(rank: int, world: int, folder: str, adapter: str, fasth3: str, pdd: str):
    import torch.distributed as dist

    from h3serve.parallel.tensor_parallel import TensorParallel

    tp = TensorParallel(rank, world, dist.group.WORLD, H3Transformer.tensor_parallel_plan)
    fused = load_transformer(folder, tp=tp, adapter=fasth3)
    fused.fuse_projections()
    fused_outputs = _run(fused, _inputs())
    dit = _adapted(folder, adapter, tp)
    lora_a = dit.get_submodule("transformer_blocks.0.attn.to_out.0").lora_a  # row-parallel: A's columns cut
    lora_b = dit.get_submodule("transformer_blocks.0.attn.to_qkv").lora_b  # column-parallel: B's rows cut
    fp8 = _adapted(folder, adapter, tp, ComponentQuant())
    assert isinstance(fp8.get_submodule("transformer_blocks.0.attn.to_out.0").base, Fp8RowParallelLinear)
    pdd_outputs = _run(_pdd_adapted(folder, pdd, tp), _inputs(), PDD_STEP)  # the AdaLN LoRA: its rows, then gathered
    outputs = _run(dit, _inputs()), tuple(lora_a.shape), tuple(lora_b.shape), _run(fp8, _inputs()), fused_outputs
    return (*outputs, pdd_outputs)


def _pdd_merged(base: H3Transformer, pdd) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own PDD model at forward PDD_STEP: every trunk target (the AdaLN projections too) merged,
    W += up @ down (alpha = rank), and the heads the bank's block of four weighted by their step on the 32-step
    grid t = 1 - shift·σ/(1 + (shift - 1)·σ)."""
    from safetensors.torch import load_file

    tensors = load_file(str(pdd))
    merged = copy.deepcopy(base)
    sigma = torch.linspace(1.0, 0.0, 33, dtype=torch.float64)
    with torch.no_grad():
        for key, down in tensors.items():
            if key.endswith(".lora_down"):
                module = key.removesuffix(".lora_down")
                merged.get_submodule(module).weight += tensors[f"{module}.lora_up"] @ down
        for head, shift in (("proj_out", 12.0), ("audio_proj_out", 3.0)):
            dt = (1 - shift * sigma / (1 + (shift - 1) * sigma)).diff()[4 * PDD_STEP : 4 * PDD_STEP + 4]
            w = (dt / dt.sum()).float()
            bank = slice(4 * PDD_STEP, 4 * PDD_STEP + 4)
            merged.get_submodule(head).weight.copy_(torch.einsum("n,noi->oi", w, tensors[f"{head}.weight"][bank]))
            merged.get_submodule(head).bias.copy_(torch.einsum("n,no->o", w, tensors[f"{head}.bias"][bank]))
    return _run(merged, _inputs())


def _within_range(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    span = (theirs.max() - theirs.min()).item()
    return span > 0.1 and (ours - theirs).abs().max().item() <= 1e-5 * span


@pytest.mark.slow
def test_tp2_lora_equals_the_test_merged_single_process_model(tmp_path):
    torch.manual_seed(0)
    base = H3Transformer(H3TransformerConfig(**SMALL_DIT)).eval()
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0, 0.2)
    folder = tmp_path / "transformer"
    folder.mkdir()
    weights = {k: v.contiguous() for k, v in base.state_dict().items()}
    save_file(weights, str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps(SMALL_DIT))
    adapter = write_peft_adapter(tmp_path / "lora", dataclasses.asdict(base.config), rank=RANK, alpha=ALPHA, seed=4)
    merged = copy.deepcopy(base)
    from safetensors.torch import load_file

    factors = load_file(str(adapter))
    with torch.no_grad():
        for key, a in factors.items():
            if ".lora_A." in key:
                module = key.split(".lora_A.")[0]
                b = factors[key.replace(".lora_A.", ".lora_B.")]
                merged.get_submodule(module).weight += SCALE * ALPHA / RANK * (b @ a)
    reference = _run(merged, _inputs())
    plain = _run(base, _inputs())
    fp8_reference = _run(_adapted(str(folder), str(adapter), quant=ComponentQuant()), _inputs())
    fasth3 = write_fasth3_adapter(tmp_path / "fasth3", dataclasses.asdict(base.config), rank=3, seed=7, std=0.2)
    one_rank_fused = _run(load_transformer(folder, adapter=str(fasth3)), _inputs())
    pdd = write_pdd_adapter(tmp_path / "pdd", dataclasses.asdict(base.config), rank=RANK, seed=5, std=0.2)
    pdd_reference = _pdd_merged(base, pdd)
    one_rank_pdd = _run(_pdd_adapted(str(folder), str(pdd)), _inputs(), PDD_STEP)
    for ours, theirs in zip(one_rank_pdd, pdd_reference, strict=True):
        assert (ours - theirs).abs().max() <= 1e-4
    results = run_ranks(2, _tp_rank, str(folder), str(adapter), str(fasth3), str(pdd))
    inner = SMALL_DIT["num_attention_heads"] * SMALL_DIT["attention_head_dim"]
    for outputs, a_shape, b_shape, fp8_outputs, fused_outputs, pdd_outputs in results:
        for ours, theirs, without in zip(pdd_outputs, pdd_reference, plain, strict=True):
            assert (ours - theirs).abs().max() <= 1e-4
            assert (ours - without).abs().max() > 1e-3
        assert a_shape == (8, inner // 2) and b_shape == (3, inner // 2, 8)
        for ours, theirs, without in zip(outputs, reference, plain, strict=True):
            assert (ours - theirs).abs().max() <= 1e-4
            assert (ours - without).abs().max() > 1e-3
        for ours, theirs, unquantized in zip(fp8_outputs, fp8_reference, outputs, strict=True):
            assert _within_range(ours, theirs)
            assert (ours - unquantized).abs().max() > 1e-4  # FP8 weights did run
        for ours, theirs, unfused in zip(fused_outputs, one_rank_fused, plain, strict=True):
            assert _within_range(ours, theirs)
            assert (ours - unfused).abs().max() > 1e-3  # the adapter was fused
