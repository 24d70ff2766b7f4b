"""Weights that hold NaN fail their clips naming the weights, not the AAC encoder; unloaded weights are collected."""

import gc
import re
import shutil
import weakref
from pathlib import Path

import pytest

from conftest import ROOT, h3gen
from faulty import TWO_CLIPS


def test_weights_unloaded_in_a_reference_cycle_are_collected(tiny_model, tmp_path):
    """The loaded stages are held out of the per-clip collection (gc.freeze); an encoder whose model sits in a
    reference cycle is still collected once it is unloaded after the last chunk, and close() hands every held
    object back to the collector."""
    import torch

    from h3gen.cli.ui import PlainReporter
    from h3gen.config.preset import resolve
    from h3gen.inputs.prompts import read_prompts
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import Registered, registry
    from h3gen.run.render import Renderer
    from h3gen.stages.encode import Qwen3VLEncoder

    loaded, held_during_render = [], []

    class CyclicEncoder(Qwen3VLEncoder):
        kind, name = "encode", "cyclic-encoder"

        def load(self, repo):
            super().load(repo)
            holder = {"weights": torch.ones(1 << 20)}
            holder["self"] = holder  # only the garbage collector frees this
            loaded.append(weakref.ref(holder["weights"]))
            self.holder = holder

        def unload(self):
            super().unload()
            self.holder = None

    found = registry()
    found.stages[("encode", "cyclic-encoder")] = Registered("encode", "cyclic-encoder", CyclicEncoder, "test")
    preset_file = tmp_path / "cyclic.toml"
    preset_file.write_text((ROOT / "presets" / "tiny.toml").read_text().replace('"qwen3vl"', '"cyclic-encoder"'))
    preset = resolve(str(preset_file), found)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(TWO_CLIPS)
    gc.disable()
    try:
        renderer = Renderer(preset, found, ModelRepo(tiny_model), PlainReporter(2))
        held_during_render.append(gc.get_freeze_count())
        results = list(renderer.render(read_prompts(prompts, 0, preset.request), tmp_path / "out"))
        assert loaded and loaded[0]() is None, "the unloaded encoder's weights are still alive"
        renderer.close()
        assert gc.get_freeze_count() == 0, "close() left objects out of the collector's reach"
    finally:
        gc.enable()
        gc.unfreeze()
    assert held_during_render[0] > 0 and [r.ok for r in results] == [True, True]


def with_nan_weights(tiny_model, tmp_path, folder: str, damaged) -> Path:
    """A copy of the tiny model whose `folder` weights named by `damaged(name)` are all NaN."""
    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / folder / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    names = [name for name in tensors if damaged(name)]
    assert names
    for name in names:
        tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return model


def test_a_dit_whose_weights_hold_a_nan_fails_its_clips_naming_the_weights(prompts_file, tmp_path, tiny_model):
    """A NaN in a weight gives latents no decode or mux can use: the clip fails at the sampler, not in the AAC
    encoder, and no file is left."""
    model = with_nan_weights(tiny_model, tmp_path, "transformer",
                             lambda name: name.endswith("norm_out.linear.weight") or name.startswith("proj_out."))
    out = tmp_path / "out"
    result = h3gen("render", prompts_file('{"id": "nan", "prompt": "x"}\n'), "-o", out, "--model", model,
                   "--preset", "tiny", check_code=1)
    assert re.search(r"sampler stage 'euler' \(built into h3gen\) returned video and audio latents holding NaN or "
                     r"infinite values \(download the model again if its weights are damaged, or try a preset "
                     r"without FP8\)", result.stderr), result.stderr
    assert "h3gen bug" not in result.stderr and not (out / "nan.mp4").exists()


@pytest.mark.parametrize("folder, vae, broken", [("vae", "fast", "the frames"), ("vae", "reference", "the frames"),
                                                 ("audio_vae", "fast", "the soundtrack")])
def test_a_decoder_whose_weights_hold_a_nan_fails_its_clips_naming_the_weights(prompts_file, tmp_path, tiny_model,
                                                                                folder, vae, broken):
    """Damaged decoder weights with finite latents: the frames would clamp to a black clip that the run calls
    written, the soundtrack would stop the AAC encoder; the decode refuses the clip instead, and no file is left."""
    model = with_nan_weights(tiny_model, tmp_path, folder, lambda name: name.startswith(("decoder.", "post_quant")))
    out = tmp_path / "out"
    result = h3gen("render", prompts_file('{"id": "nan", "prompt": "x"}\n'), "-o", out, "--model", model,
                   "--preset", "tiny", "--set", f"vae.use={vae}", "--save-latents", check_code=1)
    assert (f"vae stage '{vae}' (built into h3gen) decoded {broken} to NaN or infinite values (download the model "
            "again if its weights are damaged, or try a preset without FP8)") in result.stderr, result.stderr
    assert "h3gen bug" not in result.stderr
    assert [p.name for p in out.iterdir()] == ["manifest.jsonl"]  # no MP4, and the clip's latents went with it
