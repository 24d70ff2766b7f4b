"""Adapters fused into the DiT at load (PEFT LoRA, full-rank deltas, several at once) and their contract."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import h3gen
from h3gen.config.contract import check_adapters, find_adapter
from h3gen.errors import ModelError, UsageError
from h3gen.plugins.manager import registry
from h3gen.config.preset import resolve
from h3gen.inputs.prompts import read_prompts
from h3gen.bench.velocity_error import compare, make_probe, velocity
from h3gen.models.adapters import fuse_adapters
from test_quant import REQUEST, tiny_dit

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2", "adaln_proj.linear", "proj_out"]
FAST = "fasth3"


def peft_adapter(tiny_model, folder: Path, **options):
    """A LoRA made by peft on the tiny DiT, saved by peft; returns the peft model (the unfused reference)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False, **options)
    model = get_peft_model(tiny_dit(tiny_model, torch.float32), config).eval()
    model.save_pretrained(str(folder))
    return model


def full_rank_adapter(path: Path, dit) -> dict:
    generator = torch.Generator().manual_seed(5)
    deltas = {
        "transformer.transformer_blocks.1.attn.to_out.0.diff": dit.transformer_blocks[1].attn.to_out[0].weight,
        "transformer.transformer_blocks.0.adaln_proj.linear.diff_b": dit.transformer_blocks[0].adaln_proj.linear.bias,
        "transformer.transformer_blocks.0.norm2.diff": dit.transformer_blocks[0].norm2.weight,
        "transformer.audio_proj_out.diff_b": dit.audio_proj_out.bias,
    }
    tensors = {key: torch.randn(like.shape, generator=generator) * 0.1 for key, like in deltas.items()}
    save_file(tensors, str(path))
    return tensors


def probe_velocity(dit):
    probe = make_probe(dit.config, REQUEST, text_tokens=8, sigma=0.5)
    return velocity(dit, probe, "cpu", torch.float32)


@pytest.mark.parametrize("options", [
    dict(rank_pattern={"to_k": 2}, alpha_pattern={"to_v": 3}),
    dict(use_rslora=True),
])
def test_fused_lora_matches_the_unfused_peft_model(tiny_model, tmp_path, options):
    peft_model = peft_adapter(tiny_model, tmp_path / "lora", **options)
    expected = probe_velocity(peft_model)
    base = probe_velocity(tiny_dit(tiny_model, torch.float32))
    fused = tiny_dit(tiny_model, torch.float32)
    assert fuse_adapters(fused, [find_adapter(str(tmp_path / "lora"), None)], [1.0]) == 42 // 2
    assert compare(expected, probe_velocity(fused))["all_rel_err"] < 1e-5
    assert compare(expected, base)["all_rel_err"] > 0.05  # the adapter does change the model


def test_several_adapters_with_full_rank_deltas_at_their_scales(tiny_model, tmp_path):
    peft_model = peft_adapter(tiny_model, tmp_path / "lora")
    deltas = full_rank_adapter(tmp_path / "deltas.safetensors", peft_model.base_model.model)
    with torch.no_grad():  # the unfused reference: peft's LoRA on weights that carry the deltas at scale 0.5
        for key, delta in deltas.items():
            module, kind = key.removeprefix("transformer.").rsplit(".", 1)
            target = peft_model.base_model.model.get_submodule(module)
            target = getattr(target, "base_layer", target)
            getattr(target, "weight" if kind == "diff" else "bias").add_(0.5 * delta)
    adapters = [find_adapter(str(tmp_path / "lora"), None), find_adapter(str(tmp_path / "deltas.safetensors"), None)]
    fused = tiny_dit(tiny_model, torch.float32)
    fuse_adapters(fused, adapters, [1.0, 0.5])
    assert compare(probe_velocity(peft_model), probe_velocity(fused))["all_rel_err"] < 1e-5


def test_a_loader_can_take_the_deltas_while_reading_its_checkpoint(tiny_model, tmp_path):
    """As a DiT that concatenates Q, K and V at load would: fuse per checkpoint tensor, then nothing is left."""
    peft_adapter(tiny_model, tmp_path / "lora")
    full_rank_adapter(tmp_path / "deltas.safetensors", tiny_dit(tiny_model, torch.float32))
    paths = f'adapter.paths=["{tmp_path / "lora"}", "{tmp_path / "deltas.safetensors"}"]'
    preset = resolve("tiny", registry(), [paths, "adapter.scales=[1.0, 0.5]"])
    stage = registry().stage("quant", "none")(preset.stages["quant"][1], None)
    stage.load(None)
    state = {key: stage.checkpoint_tensor("dit", key, tensor.clone())
             for key, tensor in tiny_dit(tiny_model, torch.float32).state_dict().items()}
    qkv = torch.cat([state[f"transformer_blocks.0.attn.to_{x}.weight"] for x in "qkv"])
    read_time = tiny_dit(tiny_model, torch.float32)
    read_time.load_state_dict(state)
    assert stage.transform("dit", read_time) is read_time and not stage.adapter_deltas.pending()
    post_load = tiny_dit(tiny_model, torch.float32)
    fuse_adapters(post_load, [find_adapter(str(tmp_path / p), None) for p in ("lora", "deltas.safetensors")],
                  [1.0, 0.5])
    for key, tensor in post_load.state_dict().items():
        torch.testing.assert_close(read_time.state_dict()[key], tensor, rtol=0, atol=0)
    block = post_load.transformer_blocks[0].attn
    torch.testing.assert_close(qkv, torch.cat([block.to_q.weight, block.to_k.weight, block.to_v.weight]))


@pytest.mark.parametrize("adaln_timesteps", [None, [0.5, 1.0]])
def test_fast_dit_takes_the_adapters_while_it_loads(tiny_model, tmp_path, adaln_timesteps):
    """h3gen's DiT fuses Q, K, V and builds its AdaLN tables as it reads: the deltas go into each checkpoint tensor
    first, so it equals diffusers' DiT with the same adapters fused (fp32; measured 0 on the fly, 1.3e-7 with tables)."""
    from diffusers import MiniMaxH3Transformer3DModel

    from h3gen.models.dit.transformer import FastH3Transformer

    peft_adapter(tiny_model, tmp_path / "lora")
    full_rank_adapter(tmp_path / "deltas.safetensors", tiny_dit(tiny_model, torch.float32))
    adapters = [find_adapter(str(tmp_path / name), None) for name in ("lora", "deltas.safetensors")]
    reference = MiniMaxH3Transformer3DModel.from_pretrained(tiny_model / "transformer", torch_dtype=torch.float32)
    fuse_adapters(reference.eval(), adapters, [1.0, 0.5])
    paths = f'adapter.paths=["{tmp_path / "lora"}", "{tmp_path / "deltas.safetensors"}"]'
    preset = resolve("tiny", registry(), [paths, "adapter.scales=[1.0, 0.5]"])
    stage = registry().stage("quant", "none")(preset.stages["quant"][1], None)
    stage.load(None)
    fast = FastH3Transformer.from_pretrained(tiny_model / "transformer", dtype=torch.float32, use_triton=False,
                                             adaln_timesteps=adaln_timesteps,
                                             checkpoint_tensor=lambda key, t: stage.checkpoint_tensor("dit", key, t))
    assert not stage.adapter_deltas.pending()
    probe = make_probe(reference.config, REQUEST, text_tokens=8, sigma=0.5)
    expected, actual = velocity(reference, probe, "cpu", torch.float32), velocity(fast, probe, "cpu", torch.float32)
    assert compare(expected, actual)["all_rel_err"] < 1e-5
    assert compare(expected, probe_velocity(tiny_dit(tiny_model, torch.float32)))["all_rel_err"] > 0.05


def test_scale_multiplies_the_delta_and_the_weight_keeps_its_dtype(tiny_model, tmp_path):
    peft_adapter(tiny_model, tmp_path / "lora")
    adapter = find_adapter(str(tmp_path / "lora"), None)
    base = tiny_dit(tiny_model, torch.float32).transformer_blocks[0].attn.to_q.weight
    weights = {}
    for scale in (1.0, 0.5):
        dit = tiny_dit(tiny_model, torch.float32)
        fuse_adapters(dit, [adapter], [scale])
        weights[scale] = dit.transformer_blocks[0].attn.to_q.weight
    torch.testing.assert_close(weights[0.5] - base, 0.5 * (weights[1.0] - base), atol=1e-6, rtol=1e-5)
    dit = tiny_dit(tiny_model, torch.bfloat16)
    fuse_adapters(dit, [adapter], [1.0])
    assert dit.transformer_blocks[0].attn.to_q.weight.dtype == torch.bfloat16
    assert dit.proj_out.weight.dtype == torch.float32  # fused in fp32, cast back to what the checkpoint holds


@pytest.mark.parametrize("tensors, error, message", [
    ({"transformer_blocks.0.attn.to_z.lora_A.weight": torch.zeros(2, 64),
      "transformer_blocks.0.attn.to_z.lora_B.weight": torch.zeros(256, 2)}, ModelError,
     "adds to transformer_blocks.0.attn.to_z.weight, which this DiT does not have"),
    ({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 64)}, ModelError, "only one of lora_A"),
    ({"transformer_blocks.0.attn.to_q.diff": torch.zeros(3, 3)}, ModelError,
     r"shape \[3, 3\] for transformer_blocks.0.attn.to_q.weight of shape \[256, 64\]"),
    ({"transformer_blocks.0.attn.to_q.diff_b": torch.zeros(256)}, ModelError, "to_q.bias, which this DiT does not"),
    ({"transformer_blocks.0.attn.to_q.set_weight": torch.zeros(2)}, UsageError, "of a kind h3gen cannot fuse"),
])
def test_adapters_that_do_not_fit_are_refused_by_name(tiny_model, tmp_path, tensors, error, message):
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(error, match=message):
        preset = resolve("tiny", registry(), [f'adapter.paths=["{path}"]'])
        check_adapters(preset, [], tiny_model)
        fuse_adapters(tiny_dit(tiny_model, torch.float32), [find_adapter(str(path), None)], [1.0])


def contract_run(tmp_path, preset=FAST, overrides=(), prompts='a fox\n', sidecar=None):
    adapter = tmp_path / "models" / "adapters" / "student.safetensors"
    adapter.parent.mkdir(parents=True, exist_ok=True)
    save_file({"transformer_blocks.0.attn.to_q.diff": torch.zeros(256, 64)}, str(adapter))
    if sidecar is not None:
        adapter.with_name("student.contract.json").write_text(json.dumps(sidecar))
    resolved = resolve(preset, registry(), ['adapter.paths=["adapters/student.safetensors"]', *overrides])
    (tmp_path / "prompts.txt").write_text(prompts)
    requests = read_prompts(tmp_path / "prompts.txt", 0, resolved.request)
    return check_adapters(resolved, requests, tmp_path / "models")


def test_contract_as_shipped_passes_and_finds_the_adapter_in_the_model_directory(tmp_path):
    (adapter,) = contract_run(tmp_path)
    assert adapter.weights == tmp_path / "models" / "adapters" / "student.safetensors"


@pytest.mark.parametrize("preset, overrides, asks", [
    (FAST, ["sampler.sigma_positions=[]", "sampler.steps=9"], "this run asks for 8 DiT forwards"),
    (FAST, ["sampler.sigma_positions=[0.999, 0.7, 0.5, 0.25, 0.0]"], "asks for sigma positions 0.999, 0.7,"),
    # the same number of forwards on an evenly spaced grid is another grid
    (FAST, ["sampler.sigma_positions=[]", "sampler.steps=5"], "asks for sigma positions 1, 0.75, 0.5, 0.25, 0 before"),
    (FAST, ["sampler.video_shift=5"], "asks for video shift 5"),
    (FAST, ['adapter.tasks=["fl2va"]'], "prompts file:1: a t2va clip (text alone), and preset fasth3's adapter "
                                        "adapters/student.safetensors renders fl2va only (render those lines with a "
                                        "preset without adapters (h3-base))"),
    ("turbo-8", ["sampler.steps=5", "sampler.audio_shift=1"], "asks for 4 DiT forwards, audio shift 1"),
])
def test_contract_violations_say_what_the_adapter_requires(tmp_path, preset, overrides, asks):
    with pytest.raises(UsageError) as caught:
        contract_run(tmp_path, preset, overrides)
    message = str(caught.value)
    assert asks in message
    if preset == FAST and "tasks" not in overrides[0]:
        assert ("requires 4 DiT forwards, sigma positions 0.999, 0.749, 0.5, 0.25, 0 before the shift, "
                "video shift 12, audio shift 3, t2va only") in message


def test_a_step_count_the_preset_s_sigma_positions_would_ignore_is_refused():
    """--set sampler.steps on a preset whose explicit grid sets the forwards would change nothing: refused, so the
    run does not take another count silently; with the grid cleared, or the same count, it is taken."""
    refused = (r"^--set sampler.steps=9 would change nothing: preset fasth3 \[sampler\] sigma_positions sets the "
               r"grid's 5 points \(add --set 'sampler.sigma_positions")
    with pytest.raises(UsageError, match=refused):
        resolve(FAST, registry(), ["sampler.steps=9"])
    assert resolve(FAST, registry(), ["sampler.sigma_positions=[]", "sampler.steps=9"]).stages["sampler"][1].steps == 9
    resolve(FAST, registry(), ["sampler.steps=5"])


def test_contract_file_beside_the_weights_binds_a_preset_without_contract_keys(tmp_path):
    with pytest.raises(UsageError, match="requires 4 DiT forwards, t2va only; this run asks for 3 DiT forwards"):
        contract_run(tmp_path, "tiny", sidecar={"forwards": 4, "tasks": ["t2va"]})
    contract_run(tmp_path, "tiny", ["sampler.steps=5"], sidecar={"forwards": 4})
    with pytest.raises(UsageError, match="says forwards = 8, but the preset's"):
        contract_run(tmp_path, FAST, sidecar={"forwards": 8})
    with pytest.raises(UsageError, match=r"student.contract.json.forwards must be int"):
        contract_run(tmp_path, "tiny", sidecar={"forwards": "four"})
    with pytest.raises(UsageError, match="unknown key 'steps'"):
        contract_run(tmp_path, "tiny", sidecar={"steps": 5})


def test_missing_adapter_names_where_it_looked(tmp_path):
    preset = resolve(FAST, registry())
    with pytest.raises(UsageError, match=r"adapter adapters/fasth3.safetensors not found \(looked in .*nowhere"):
        check_adapters(preset, [], tmp_path / "nowhere")


def test_render_stops_on_a_contract_violation_before_loading(tiny_model, tmp_path):
    adapter = tmp_path / "student.safetensors"
    save_file({"proj_out.diff_b": torch.zeros(96)}, str(adapter))
    (tmp_path / "p.txt").write_text("a fox\n")
    result = h3gen("render", tmp_path / "p.txt", "-o", tmp_path / "out", "--model", tiny_model, "--preset", FAST,
                   "--set", "model.needs=any", "--set", f'adapter.paths=["{adapter}"]', "--set", "sampler.steps=9",
                   "--set", "sampler.sigma_positions=[]", check_code=2)
    assert "requires 4 DiT forwards" in result.stderr and "asks for 8 DiT forwards" in result.stderr
    assert "loaded on" not in result.stderr and not list((tmp_path / "out").glob("*.mp4"))


@pytest.mark.parametrize("dit", ["diffusers", "h3gen"])
def test_render_fuses_the_adapter_into_a_quantized_dit(tiny_model, tmp_path, dit):
    """End to end, on either DiT: an adapter that adds 50 to the audio head's bias must show in the audio latents."""
    from safetensors.torch import load_file

    adapter = tmp_path / "loud.safetensors"
    save_file({"audio_proj_out.diff_b": torch.full((32,), 25.0)}, str(adapter))
    (tmp_path / "p.txt").write_text('{"id": "fox", "prompt": "a fox"}\n')
    h3gen("render", tmp_path / "p.txt", "-o", tmp_path, "--model", tiny_model, "--preset", "tiny", "--set", "quant.use=fp8-rowwise",
          "--set", f'sampler.dit="{dit}"',
          "--set", f'adapter.paths=["{adapter}"]', "--set", "adapter.scale=2", "--save-latents", check_code=0)
    latents = load_file(str(tmp_path / "fox.latents.safetensors"))
    # x0 = x_t + sigma * v summed over the grid: a velocity offset of 50 moves the audio latents by about 50.
    assert 40 < float(latents["audio"].mean()) < 60 and abs(float(latents["video"].mean())) < 5


@pytest.mark.parametrize("content, said", [
    ("pickle", "truncated, or not safetensors: its header would be longer than the file"),  # torch.save's
    (bytes(range(256)) * 4, "truncated, or not safetensors"),
    (None, "truncated"),  # a real adapter cut short
])
def test_an_adapter_file_that_is_not_whole_safetensors_is_one_line_before_loading(tmp_path, content, said):
    path = tmp_path / "style.safetensors"
    save_file({"a.lora_A.weight": torch.ones(2, 4), "a.lora_B.weight": torch.ones(4, 2)}, str(path))
    if content == "pickle":
        torch.save({"a.lora_A.weight": torch.ones(2, 4)}, path)
    else:
        path.write_bytes(path.read_bytes()[:-3] if content is None else content)
    preset = resolve("tiny", registry(), [f'adapter.paths=["{path}"]'])
    with pytest.raises(UsageError, match=f"^adapter {path} is not a readable safetensors file \\({said}") as caught:
        check_adapters(preset, [], tmp_path)
    assert caught.value.fix == "re-download it, or export it again"


@pytest.mark.parametrize("config, said", [
    ("{not json", "cannot read .*adapter_config.json \\(Expecting property name"),
    ('{"lora_alpha": "eight"}', "is not a PEFT adapter config h3gen can read"),
    ('{"alpha_pattern": {"blocks.0": null}}', "is not a PEFT adapter config h3gen can read"),
    ('{"alpha_pattern": {"blocks.(": 4}}', "alpha_pattern key 'blocks.\\(' is not a regular expression"),
    ('{"use_dora": true}', "DoRA adapters cannot be fused"),
])
def test_a_peft_folder_s_config_h3gen_cannot_use_is_one_line_before_loading(tmp_path, config, said):
    folder = tmp_path / "peft"
    folder.mkdir()
    save_file({"a.lora_A.weight": torch.ones(2, 4), "a.lora_B.weight": torch.ones(4, 2)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(config)
    preset = resolve("tiny", registry(), [f'adapter.paths=["{folder}"]'])
    with pytest.raises(UsageError, match=said):
        check_adapters(preset, [], tmp_path)
