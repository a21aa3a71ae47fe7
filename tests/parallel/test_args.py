"""Engine flags: vLLM-Omni recipe lines parse into an EngineConfig; what cannot apply is refused or announced."""

from __future__ import annotations

import argparse
import shlex

import pytest

from h3serve.accel.cache_profile import server_cache_profile
from h3serve.config_checks import check_config, notices
from h3serve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from h3serve.errors import ConfigError
from h3serve.rank.device_checks import check_engine

# Every flag of the reference's launch-recipe table (§5) and its "related flags" list.
RECIPE = (
    "--omni --trust-remote-code --task-type combined --num-gpus 4 --tensor-parallel-size 1 --usp 2 --ring 2 "
    "--text-encoder-tp-size 2 --vae-patch-parallel-size 4 --vae-parallel-mode tile --vae-use-tiling "
    "--enforce-eager --diffusion-attention-backend TORCH_SDPA --cache-backend none --cfg-parallel-size 1 "
    "--diffusion-compile-granularity regional --ulysses-mode strict --stage-init-timeout 300 --init-timeout 900 "
    "--api-server-count 1 --enable-diffusion-pipeline-profiler --fa-deterministic --request-batch-max-wait-ms 0 "
    "--step-execution --dlo-no-use-allgather --dlo-resident-layers 2 --enable-distributed-layerwise-offload "
    "--diffusion-compile-dynamic --ulysses-a2a-permute"
)


def _parse(line: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    add_engine_args(parser)
    return parser.parse_args(shlex.split(line))


def test_a_full_recipe_line_runs_and_says_what_it_changed(parallel_checkpoint, capsys):
    config = engine_config_from_args(_parse(RECIPE + " --device cpu"), parallel_checkpoint)
    assert (config.world_size, config.ulysses_degree, config.ring_degree) == (4, 2, 2)
    assert (config.text_encoder_tp_size, config.vae_patch_parallel_size, config.task_type) == (2, 4, "auto")
    assert config.enforce_eager and config.attention_backend == "TORCH_SDPA" and config.init_timeout_s == 900
    assert config.offload.distributed and config.offload.transfer == "rank-local"
    assert config.offload.resident_layers == 2 and config.offload.streamed == {"dit", "text_encoder"}
    notices = capsys.readouterr().err.splitlines()
    assert all(line.startswith("notice: ") for line in notices)
    for flag in ("--omni", "--trust-remote-code", "--vae-use-tiling",
                 "offload on CPU", "--diffusion-compile-*", "--step-execution", "--num-gpus 4 on CPU"):
        assert any(flag in line for line in notices), flag


@pytest.mark.parametrize(
    "line, message",
    [
        ("--cache-backend tea_cache --task-type ref2va", "only supports the MiniMax-H3 FL2VA partition; Ref2VA"),
        ("--cache-backend tea_cache --cache-config '{\"Fn_compute_blocks\": 2}'",
         "unknown keys Fn_compute_blocks for --cache-backend tea_cache; choose from: rel_l1_thresh, coefficients"),
        ("--cache-backend tea_cache --cache-config '{\"rel_l1_thresh\": -1}'", "rel_l1_thresh must be .* >= 0"),
        ("--cache-backend tea_cache --enable-layerwise-offload", "tea_cache is not available with layerwise offload"),
        ("--cache-backend tea_cache --diffusion-compile-granularity full", "tea_cache .* use 'regional'"),
        ("--cache-backend mag_cache", "not available in h3serve; choose from: none, cache_dit, tea_cache"),
        ("--cache-backend magic", "choose from: none, cache_dit"),
        ("--cache-backend cache_dit --cache-config '{\"Fn\": 2}'", "unknown keys Fn; choose from: Fn_compute_blocks"),
        ("--cache-backend cache_dit --usp 2", "not available with sequence parallelism"),
        ("--cache-backend cache_dit --diffusion-compile-granularity full", "'full' .* use 'regional'"),
        ("--cache-backend cache_dit --num-gpus 2 -tp 2", "several CPU ranks .* gloo lacks"),
        ("--cache-backend cache_dit --enable-layerwise-offload", "not available with layerwise offload"),
        ("--lora-path /x.safetensors", "--lora-path x=/x.safetensors: x.safetensors: no such adapter file"),
        ("--lora-path a=/x --lora-path a=/y", "--lora-path: the name a is given twice"),
        ("--lora-backend distill", "h3serve applies LoRA unmerged; use peft"),
        ("--lora-dir /nonexistent-dir", "--lora-dir /nonexistent-dir: not a directory"),
        ("--deploy-config d.yaml", "h3serve runs H3 as one stage"),
        ("--api-server-count 2", "use 1"),
        ("--allgather-degree 2", "use --usp and/or --ring"),
        ("--diffusion-attention-backend SAGE_ATTN", "would change the attention math"),
        ("--diffusion-attention-backend NOPE", "NOPE: unknown backend; available on cpu: TORCH_SDPA$"),
        ("--diffusion-attention-backend FLASH_ATTN", "FLASH_ATTN: needs a CUDA device; available on cpu: TORCH_SDPA"),
        ("--diffusion-attention-backend TRTLLM_ATTN", "trtllm-gen kernels .* not wired"),
        ("-dac '{\"per_role\": {\"minimax_h3.token_refiner\": {\"backend\": \"CUDNN_ATTN\"}}}'",
         "per_role.minimax_h3.token_refiner CUDNN_ATTN: needs a CUDA device"),
        ("-dac '{\"per_role\": {\"cross\": {\"backend\": \"TORCH_SDPA\"}}}'",
         "unknown roles cross; choose from: self, minimax_h3.token_refiner"),
        ("--diffusion-attention-backend FLASH_ATTN -dac '{\"default\": {\"backend\": \"TORCH_SDPA\"}}'",
         "mutually exclusive"),
        ("-dac '[1]'", "expected a JSON object"),
        ("--task-type t2v", "choose from: auto, combined, t2va, fl2va, ref2va"),
        ("--diffusion-compile-granularity everything", "choose from: regional, full"),
        ("--diffusion-compile-backend tvm", "choose from: inductor, aot_eager, eager"),
        ("--diffusion-compile-granularity full --usp 2", "incompatible with sequence parallelism and offload"),
        ("--diffusion-compile-granularity full --enable-layerwise-offload", "use 'regional' compilation instead"),
        ("--cfg-parallel-size 2", "CFG-distilled"),
        ("--usp 8", "choose from: 1, 2, 4"),
        ("--collective-timeout 0", "--collective-timeout must be > 0 seconds, got 0"),
    ],
)
def test_what_cannot_apply_is_refused_with_the_fix(parallel_checkpoint, line, message):
    with pytest.raises(ConfigError, match=message):  # in the parent, else in the rank's start-up check (torch)
        check_engine(engine_config_from_args(_parse(line + " --device cpu"), parallel_checkpoint))


def test_compile_flags_become_engine_fields(parallel_checkpoint):
    config = engine_config_from_args(_parse("--device cpu"), parallel_checkpoint)
    assert config.compile_mode("cpu") is None and config.compile_dynamic  # CPU: eager unless a granularity is named
    line = "--device cpu --diffusion-compile-granularity regional --no-diffusion-compile-dynamic"
    config = engine_config_from_args(_parse(line), parallel_checkpoint)
    assert config.compile_mode("cpu") == "regional" and not config.compile_dynamic
    assert config.compile_backend == "inductor"
    config = engine_config_from_args(_parse(line + " --diffusion-compile-backend eager"), parallel_checkpoint)
    assert config.compile_backend == "eager"  # Dynamo capture only (tests/api/test_lora_live.py counts graphs)
    config = engine_config_from_args(_parse(line + " --enforce-eager"), parallel_checkpoint)
    assert config.compile_mode("cpu") is None


def test_the_collective_timeout_sets_the_process_group_timeout_with_a_keepalive_under_it(parallel_checkpoint):
    default = engine_config_from_args(_parse("--device cpu"), parallel_checkpoint)
    assert (default.collective_timeout_s, default.idle_keepalive_s) == (None, 60.0)  # torch's timeout (gloo: 30 min)
    short = engine_config_from_args(_parse("--device cpu --collective-timeout 20"), parallel_checkpoint)
    assert (short.collective_timeout_s, short.idle_keepalive_s) == (20.0, 5.0)
    long = engine_config_from_args(_parse("--device cpu --collective-timeout 900"), parallel_checkpoint)
    assert (long.collective_timeout_s, long.idle_keepalive_s) == (900.0, 60.0)


def test_cache_flags_become_the_server_profile(parallel_checkpoint):
    line = "--device cpu --cache-backend cache_dit --cache-config '{\"residual_diff_threshold\": 0.08}'"
    config = engine_config_from_args(_parse(line), parallel_checkpoint)
    profile = server_cache_profile(config)
    assert profile.residual_diff_threshold == 0.08 and profile.max_warmup_steps == 4
    assert server_cache_profile(engine_config_from_args(_parse("--device cpu"), parallel_checkpoint)) is None
    # TeaCache: vLLM-Omni's calibration unless given; sequence parallelism allowed (the ranks agree on each step);
    # combined serving caches the FL2VA DiT only, said once at start-up.
    line = "--device cpu --cache-backend tea_cache --usp 2 --cache-config '{\"rel_l1_thresh\": 0.2}'"
    config = engine_config_from_args(_parse(line), parallel_checkpoint)
    profile = server_cache_profile(config)
    assert profile.rel_l1_thresh == 0.2 and profile.coefficients[0] == 2283.7040658527776
    assert any("Ref2VA requests run uncached" in line for line in notices(config))
    check_engine(config)  # the rank's start-up check lets it through too


def test_task_types_map_onto_the_dits_to_load(parallel_checkpoint):
    for given, dits in (("t2va", ("transformer",)), ("combined", ("transformer", "transformer_ref"))):
        config = engine_config_from_args(_parse(f"--task-type {given} --device cpu"), parallel_checkpoint)
        assert config.dits == dits


def test_defaults_are_one_rank(parallel_checkpoint, capsys):
    config = engine_config_from_args(_parse(f"--model {parallel_checkpoint} --device cpu"))
    assert config.world_size == 1 and notices(config) == []
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "line, layout",
    [
        ("", (0, 1)),
        ("--num-gpus 4", (1, 4)),  # the remainder beyond tp·usp·ring is data parallel, as in vLLM-Omni
        ("--num-gpus 8 -tp 2", (2, 4)),
        ("--num-gpus 4 --usp 2 --data-parallel-size 2", (2, 2)),
        ("--data-parallel-size 3", (0, 3)),
        ("--num-gpus 2 --text-encoder-tp-size 2", (2, 1)),  # the extra rank serves the text encoder
        ("--num-gpus 4 --usp 2 --ring 2", (4, 1)),
    ],
)
def test_num_gpus_beyond_the_parallel_degrees_becomes_replicas(line, layout):
    from h3serve.entrypoints.engine_args import data_parallel_layout

    assert data_parallel_layout(_parse(line)) == layout


def test_illegal_data_parallel_layouts_name_the_flag():
    from h3serve.entrypoints.engine_args import data_parallel_layout

    with pytest.raises(ConfigError, match="--data-parallel-size must be >= 1"):
        data_parallel_layout(_parse("--data-parallel-size 0"))
    with pytest.raises(ConfigError, match="--num-gpus 3 must be a multiple of --data-parallel-size 2"):
        data_parallel_layout(_parse("--num-gpus 3 --data-parallel-size 2"))


@pytest.mark.parametrize("layout", [{"ulysses_degree": 2}, {"data_parallel_size": 2}])
def test_one_named_gpu_with_several_ranks_is_refused(parallel_checkpoint, layout):
    """Each rank takes the GPU of its local rank: a named GPU would put every rank (and NCCL's view) apart."""
    from h3serve.config.engine_config import EngineConfig

    with pytest.raises(ConfigError, match=r"--device cuda:1 names one GPU, but this engine runs 2 ranks .* "
                                          "use --device cuda and choose the GPUs with CUDA_VISIBLE_DEVICES"):
        check_config(EngineConfig(model=parallel_checkpoint, device="cuda:1", **layout))
