"""The Fun ControlNet Union branch against the test's own fp32 reference, written from the release's description
(not from h3serve's control code): the video tokens' control columns embedded in place of their stream rows,
`before_proj` of that plus the stream into the control blocks (the DiT's block math), each block's `after_proj` a
hint with the audio rows zeroed, added after main blocks 0, 2, 4 (3 control blocks over 6) times the scale."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from h3serve.errors import ConfigError
from h3serve.loading.controlnet_weights import read_controlnet
from h3serve.model.controlnet import ControlInput, control_places, control_rows
from h3serve.model.layout import TEXT_TAG, build_keyframe_layout, patchify
from h3serve.model.transformer import TransformerBlock
from h3serve.tools.tiny.make_adapter import save_file, write_controlnet
from h3serve.tools.tiny.make_checkpoint import PRESETS

CFG = dict(PRESETS["tiny"].transformer)


@pytest.fixture(scope="module")
def dit_and_file(tiny_pipeline, tmp_path_factory):
    pipeline, _ = tiny_pipeline
    dit = pipeline.components.transformer
    path = write_controlnet(tmp_path_factory.mktemp("control"), CFG, blocks=3, seed=4, std=0.2)
    return dit, path


def _inputs(dit):
    g = torch.Generator().manual_seed(1)
    frames, text_len, lh, lw = 3, 7, 4, 8
    layout = build_keyframe_layout(torch.full((text_len,), TEXT_TAG), frames, lh, lw, 3 * frames, anchors=())
    video = patchify(torch.randn(1, 24, frames, lh, lw, generator=g))[None]
    audio = torch.randn(1, 6 * frames, 32, generator=g)
    text = dit.embed_text(torch.randn(1, text_len, CFG["text_dim"], generator=g))
    timestep, row_index = layout.row_timesteps(0.3, 0.6)
    rows = torch.randn(1, video.shape[1], 196, generator=g)
    return video, audio, text, timestep, row_index, layout.packed, rows


def _reference(dit, path, inputs, scale: float):
    """The DiT with the branch added by hooks: the file's tensors applied by hand, blocks run as DiT blocks."""
    video, audio, text, timestep, row_index, packed, rows = inputs
    w = load_file(str(path))
    blocks = []
    for i in range(3):
        block = TransformerBlock(dit.config)
        block.load_state_dict({k.removeprefix(f"control_blocks.{i}."): v for k, v in w.items()
                               if k.startswith(f"control_blocks.{i}.") and "_proj." not in k.replace("adaln_proj", "")})
        blocks.append(block.eval())
    hints = {}

    def branch(module, args):
        x, temb, adaln_idx, rotary = args
        embeds = rows.float() @ w["control_proj_in.weight"].T + w["control_proj_in.bias"]
        stream = x.clone()
        stream[:, packed.video_indices] = embeds
        stream = stream @ w["control_blocks.0.before_proj.weight"].T + w["control_blocks.0.before_proj.bias"] + x
        for i, (place, block) in enumerate(zip((0, 2, 4), blocks, strict=True)):
            stream = block(stream, temb, adaln_idx, rotary)
            hint = stream @ w[f"control_blocks.{i}.after_proj.weight"].T + w[f"control_blocks.{i}.after_proj.bias"]
            hint[:, packed.audio_indices] = 0
            hints[place] = hint

    def add(place):
        return lambda module, args, out: out + hints[place] * scale

    handles = [dit.transformer_blocks[0].register_forward_pre_hook(branch)]
    handles += [dit.transformer_blocks[p].register_forward_hook(add(p)) for p in (0, 2, 4)]
    try:
        with torch.no_grad():
            return dit(video, audio, text, timestep, row_index, packed)
    finally:
        for handle in handles:
            handle.remove()


def test_the_branch_equals_the_tests_own_reference_and_scale_0_is_the_base(dit_and_file):
    dit, path = dit_and_file
    inputs = _inputs(dit)
    video, audio, text, timestep, row_index, packed, rows = inputs
    dit.controlnet = read_controlnet(path, dit.config, torch.device("cpu"), torch.float32)
    try:
        assert dit.controlnet.places == (0, 2, 4)
        with torch.no_grad():
            base = dit(video, audio, text, timestep, row_index, packed)
            for scale in (1.0, 0.6):
                ours = dit(video, audio, text, timestep, row_index, packed, control=ControlInput(rows, scale))
                theirs = _reference(dit, path, inputs, scale)
                for mine, ref, plain in zip(ours, theirs, base, strict=True):
                    assert (mine - ref).abs().max() <= 1e-5
                    assert (mine - plain).abs().max() > 1e-3  # the control shows
            off = dit(video, audio, text, timestep, row_index, packed, control=ControlInput(rows, 0.0))
            assert all(torch.equal(a, b) for a, b in zip(off, base, strict=True))  # scale 0: bit for bit
    finally:
        dit.controlnet = None


def test_the_file_is_read_by_exact_key_match(dit_and_file, tmp_path):
    dit, path = dit_and_file
    tensors = load_file(str(path))

    def refused(change) -> str:
        changed = dict(tensors)
        change(changed)
        bad = tmp_path / "bad.safetensors"
        save_file(changed, str(bad))
        with pytest.raises(ConfigError) as e:
            read_controlnet(bad, dit.config, torch.device("cpu"), torch.float32)
        return str(e.value)

    assert "missing key control_blocks.1.after_proj.bias" in refused(
        lambda t: t.pop("control_blocks.1.after_proj.bias"))
    assert "unexpected key control_blocks.1.before_proj.weight" in refused(
        lambda t: t.update({"control_blocks.1.before_proj.weight": torch.zeros(48, 48)}))
    assert "control_proj_in.weight has shape [48, 195]" in refused(
        lambda t: t.update({"control_proj_in.weight": torch.zeros(48, 195)}))
    assert "7 control blocks for 6" in refused(
        lambda t: t.update({"control_blocks.6.after_proj.bias": torch.zeros(48)}))


def test_control_rows_put_each_part_in_its_columns():
    g = torch.Generator().manual_seed(0)
    shape = (2, 4, 6)
    control, source = (torch.randn(1, 24, *shape, generator=g) for _ in range(2))
    visible = (torch.rand(1, 1, *shape, generator=g) > 0.5).float()
    rows = control_rows(control, visible, source, shape)
    assert rows.shape == (1, 2 * 2 * 3, 196)
    assert torch.equal(rows[0, :, :96], patchify(control)) and torch.equal(rows[0, :, 96:100], patchify(visible))
    assert torch.equal(rows[0, :, 100:], patchify(source))
    no_mask = control_rows(control, None, None, shape)
    assert torch.equal(no_mask[0, :, :96], patchify(control)) and not no_mask[0, :, 96:].any()
    inpaint = control_rows(None, visible, source, shape)
    assert not inpaint[0, :, :96].any() and torch.equal(inpaint[0, :, 96:100], patchify(visible))
    with pytest.raises(ValueError, match="latent grid"):
        control_rows(control, None, None, (2, 4, 8))
    assert control_places(50, 5) == (0, 10, 20, 30, 40)


def test_a_batch_of_two_gets_the_same_branch(dit_and_file):
    """Several outputs run as one batch: the control rows serve every item."""
    dit, path = dit_and_file
    video, audio, text, timestep, row_index, packed, rows = _inputs(dit)
    dit.controlnet = read_controlnet(path, dit.config, torch.device("cpu"), torch.float32)
    try:
        with torch.no_grad():
            one = dit(video, audio, text, timestep, row_index, packed, control=ControlInput(rows, 1.0))
            two = dit(video.expand(2, -1, -1), audio.expand(2, -1, -1), text.expand(2, -1, -1), timestep, row_index,
                      packed, control=ControlInput(rows, 1.0))
        for a, b in zip(one, two, strict=True):  # the same math; a GEMM over twice the rows may round apart
            assert (b[0] - a[0]).abs().max() <= 1e-5 and (b[1] - a[0]).abs().max() <= 1e-5
    finally:
        dit.controlnet = None


def test_the_released_branch_on_the_meta_device():
    """The full-size DiT with the release's 5 control blocks: hints after blocks 0, 10, 20, 30, 40; the input
    projection [5376, 196]; block 0 alone has before_proj."""
    from h3serve.model.controlnet import ControlNet
    from h3serve.model.transformer_config import H3TransformerConfig

    with torch.device("meta"):
        net = ControlNet(H3TransformerConfig(), 5)
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    assert net.places == (0, 10, 20, 30, 40) and shapes["control_proj_in.weight"] == (5376, 196)
    assert shapes["control_blocks.0.before_proj.weight"] == (5376, 5376)
    assert "control_blocks.1.before_proj.weight" not in shapes
    assert shapes["control_blocks.4.adaln_proj.linear.weight"] == (18 * 5376, 2688)
