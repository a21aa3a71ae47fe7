"""DLO all-gather load (h3serve.loading.dit_pieces): the pieces of the streamed DiT blocks a rank reads from the files
row by row are byte-identical to those cut from the whole loaded DiT (modular and native layouts, sharded files,
fp32 and bf16, FP8 online per channel and per tensor and stored, FastH3, a merged LoRA, LoRA factors, tensor
parallelism), and a rank reads, counted at safe_open, only the resident parts and its piece of the blocks (about 1/G
of them)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from read_counter import counting_reads, dit_file_bytes, read_under
from safetensors.torch import load_file, save_file

from h3serve.adapters.catalog import lora_file
from h3serve.adapters.peft import target_shapes
from h3serve.adapters.weight_edits import lora_edits
from h3serve.checkpoint.resolver import CheckpointError
from h3serve.config.quantization_config import ComponentQuant
from h3serve.loading import dit_keys as keys
from h3serve.loading.components import load_transformer
from h3serve.loading.dit_pieces import BlockPieces
from h3serve.model.transformer import H3Transformer
from h3serve.offload.pieces import PieceSources, cut_piece
from h3serve.offload.placement_plan import DIT_GROUPS
from h3serve.offload.runtime import adaln_modules
from h3serve.offload.units import gathered_layout, gathered_values
from h3serve.parallel.tensor_parallel import TensorParallel
from h3serve.rank.lora import LoraLinear, LoraScale, install_lora
from h3serve.tools.tiny.make_adapter import write_fasth3_adapter, write_peft_adapter

CPU = torch.device("cpu")
BF16, PER_CHANNEL, PER_TENSOR = torch.bfloat16, ComponentQuant(), ComponentQuant(granularity="per_tensor")


@pytest.fixture(scope="module")
def folders(tiny_checkpoint, tiny_native_checkpoint, tmp_path_factory):
    """DiT folders: modular (one file, three shards), native (the two MiniMaxAI shards, a stacked export, stored
    FP8), and a FastH3 adapter for the modular one."""
    root = tmp_path_factory.mktemp("pieces")
    modular = tiny_checkpoint / "transformer"
    out = {"modular": modular, "native": tiny_native_checkpoint / "FL2VA" / "transformer"}
    tensors, config = load_file(str(modular / "diffusion_pytorch_model.safetensors")), modular / "config.json"
    out["modular-shards"] = _write(root / "modular-shards", tensors, config, shards=3)
    whole = load_transformer(modular)
    head_dim = whole.config.attention_head_dim
    stacked = keys.diffusers_to_native(whole.state_dict(), head_dim, "stacked")
    cfg = json.loads(config.read_text())
    folder = _write(root / "native-stacked", stacked, config, shards=1)
    (folder / "config.json").write_text(json.dumps({**cfg, "qkv_layout": "stacked"}))
    out["native-stacked"] = folder
    fp8 = load_transformer(modular, quant=ComponentQuant()).state_dict()
    out["native-fp8"] = _write(root / "native-fp8", keys.diffusers_to_native(fp8, head_dim, "interleaved"), config, 1)
    out["fasth3"] = write_fasth3_adapter(root / "fasth3", cfg, rank=3, seed=5, std=0.2).parent
    out["peft"] = write_peft_adapter(root / "peft", cfg, rank=3, seed=6, std=0.2)
    return out


def _merged(folders, scale: float = 0.5):
    """--merge-lora's edits of the peft adapter (fused at load like FastH3's, at scale · alpha / r)."""
    cfg = json.loads((folders["modular"] / "config.json").read_text())
    return lora_edits(lora_file(folders["peft"], target_shapes(cfg)), scale)


def _write(folder, tensors, config, shards):
    folder.mkdir()
    shutil.copy(config, folder / "config.json")
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[i * shards // len(names)] for i, name in enumerate(names)}
    for file in files:
        save_file({n: tensors[n].contiguous() for n in names if weight_map[n] == file}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def _blocks(model):
    return [block for group in DIT_GROUPS for block in model.get_submodule(group)]


def _wired(model, adaln_host: bool, lora: bool) -> tuple:
    """What the engine does between the load and the offload units (Q/K/V fusion, LoRA wrappers), and the modules
    the gathered units skip (the AdaLN projections kept on host, the LoRA scale)."""
    model.fuse_projections()
    skip = tuple(adaln_modules(model)) if adaln_host else ()
    if lora:
        scale = LoraScale(CPU)
        install_lora(model, 4, scale)
        skip += (scale,)
    return skip


def _wrappers(model) -> list[LoraLinear]:
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def _whole_then_cut(model, skip, rank, size) -> list[dict]:
    """The old way: every block's whole flat buffers, then this rank's slice of each."""
    out = []
    for block in _blocks(model):
        values = gathered_values(block, skip, None)
        offsets, totals = gathered_layout(values, CPU)
        flats = {}
        for dtype, total in totals.items():
            piece = -(-total // size)
            flat = torch.zeros(piece * size, dtype=dtype)
            for v, start in zip(values, offsets, strict=True):
                if v.dtype == dtype:
                    flat[start : start + v.numel()] = v.reshape(-1)
            flats[dtype] = flat[rank * piece : (rank + 1) * piece]
        out.append(flats)
    return out


def _read_pieces(model, sources, skip, rank, size) -> list[dict]:
    """What `GatheredUnit` keeps: each block's pieces, read from the sources."""
    out = []
    for block in _blocks(model):
        values = gathered_values(block, skip, sources)
        offsets, totals = gathered_layout(values, CPU)
        out.append({d: cut_piece(values, offsets, d, n, rank, size) for d, n in totals.items()})
    return out


CASES = {  # folder, load arguments, G, AdaLN projections on host, LoRA wrappers, TP rank of 2 (None: no TP)
    "modular-fp32-lora": ("modular", {}, 2, False, True, None),
    "native-shards-bf16": ("native", {"dtype": BF16}, 3, True, False, None),
    "modular-shards-fp8": ("modular-shards", {"dtype": BF16, "quant": PER_CHANNEL}, 3, True, False, None),
    "stacked-fp8-per-tensor": ("native-stacked", {"quant": PER_TENSOR}, 2, False, False, None),
    "native-stored-fp8": ("native-fp8", {"dtype": BF16}, 2, True, True, None),
    "tp2-fasth3-bf16": ("modular", {"dtype": BF16, "adapter": "fasth3"}, 2, False, False, 1),
    "tp2-merged-lora-bf16": ("modular", {"dtype": BF16, "merged": True}, 2, False, False, 0),
    "merged-lora-fp8": ("modular-shards", {"dtype": BF16, "quant": PER_CHANNEL, "merged": True}, 2, True, False, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_reads_exactly_its_old_piece_and_little_else(folders, case):
    name, kwargs, size, adaln_host, lora, tp_rank = CASES[case]
    folder = folders[name]
    if "adapter" in kwargs:
        kwargs = {**kwargs, "adapter": str(folders[kwargs["adapter"]])}
    if "merged" in kwargs:
        kwargs = {**kwargs, "merged": _merged(folders)}
    tp = None if tp_rank is None else TensorParallel(tp_rank, 2, None, H3Transformer.tensor_parallel_plan)
    with counting_reads() as counts:
        whole = load_transformer(folder, tp=tp, **kwargs)
    resident, blocks, rows = dit_file_bytes(folder, BlockPieces(PieceSources(), adaln_host).lazy)
    if tp is None:  # the counter sees every byte the whole load reads
        assert read_under(counts, folder) == resident + blocks
    skip = _wired(whole, adaln_host, lora)
    for rank in range(size):
        want = _whole_then_cut(whole, skip, rank, size)
        sources = PieceSources()
        with counting_reads() as counts:
            model = load_transformer(folder, tp=tp, pieces=BlockPieces(sources, adaln_host), **kwargs)
            got = _read_pieces(model, sources, _wired(model, adaln_host, lora), rank, size)
        assert len(got) == len(want) == len(_blocks(model))
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            assert w.keys() == g.keys(), i
            for dtype in w:
                assert torch.equal(w[dtype].view(torch.uint8), g[dtype].view(torch.uint8)), (rank, i, dtype)
        read = read_under(counts, folder)
        # A piece is 1/G of the flat buffers, where the LoRA factors (zeros, never read) take their share too.
        shared = (blocks + 4 * sum(b.lora_a.numel() + b.lora_b.numel() for b in _wrappers(model))) / size
        if "quant" not in kwargs:  # the resident parts and this rank's piece of the blocks
            assert read <= resident + shared + rows, (rank, read, resident, blocks)
        elif kwargs["quant"].per_channel:  # + the rows its piece of the FP8 scales scales, where not read already
            assert read <= resident + 1.25 * shared + 2 * rows, (rank, read, resident, blocks)
        else:  # a per-tensor scale is the whole weight's maximum: each FP8 weight is read whole once, for it
            assert read <= resident + blocks + shared + rows, (rank, read, resident, blocks)
        assert "quant" in kwargs and not kwargs["quant"].per_channel or read < resident + blocks


@pytest.mark.parametrize("quant", [ComponentQuant(adaln=True), PER_TENSOR], ids=["per-channel", "per-tensor"])
def test_under_tensor_parallelism_fp8_pieces_are_slices_of_the_one_rank_fp8_weights(folders, quant):
    """TP2 + online FP8: every block tensor's source yields exactly this rank's slice of the one-rank FP8 tensor
    (whose maxima the whole-tensor load all-reduces over the TP group; here they are read from the file)."""
    folder = folders["native"]
    one_rank = load_transformer(folder, quant=quant)
    one_rank.fuse_projections()
    full = one_rank.state_dict()
    cfg = one_rank.config
    inner, checked = cfg.num_attention_heads * cfg.attention_head_dim, 0
    for rank in range(2):
        tp = TensorParallel(rank, 2, None, H3Transformer.tensor_parallel_plan)
        sources = PieceSources()
        model = load_transformer(folder, tp=tp, quant=quant, pieces=BlockPieces(sources, False))
        model.fuse_projections()
        for group in DIT_GROUPS:
            for path, module in model.get_submodule(group).named_modules(prefix=group):
                for attr in [*module._parameters, *module._buffers]:
                    source, name = sources.get(module, attr), f"{path}.{attr}"
                    got = source.rows(0, source.shape[0] if source.shape else 1)
                    if path.endswith(".attn.to_qkv"):  # [q; k; v] of this rank's heads
                        k = inner // 2
                        spans = [(p * inner + rank * k, p * inner + (rank + 1) * k) for p in range(3)]
                        want = TensorParallel.cut_ranges(full[name], (0, spans))
                    else:
                        want = tp.cut(name, full[name])
                    assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
                    checked += got.dtype == torch.float8_e4m3fn
    assert checked >= 2 * 4 * len(_blocks(one_rank))  # QKV, out, FFN in and out of every block, on both ranks


def test_a_missing_block_weight_is_named(folders, tmp_path):
    tensors = load_file(str(folders["modular"] / "diffusion_pytorch_model.safetensors"))
    del tensors["transformer_blocks.2.ff.net.2.weight"]
    folder = _write(tmp_path / "holey", tensors, folders["modular"] / "config.json", shards=2)
    with pytest.raises(CheckpointError, match=r"1 weights missing .*transformer_blocks\.2\.ff\.net\.2\.weight"):
        load_transformer(folder, pieces=BlockPieces(PieceSources(), False))


def test_an_adapter_is_never_merged_into_a_weight_stored_in_fp8(folders):
    """A stored FP8 weight's values mean nothing without its scale: merging into it is refused by name, whole or in
    pieces."""
    with pytest.raises(ValueError, match="stored in FP8"):
        load_transformer(folders["native-fp8"], merged=_merged(folders))
    with pytest.raises(CheckpointError, match="stored in FP8"):
        load_transformer(folders["native-fp8"], merged=_merged(folders), pieces=BlockPieces(PieceSources(), False))
