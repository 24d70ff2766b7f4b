"""fl2va (keyframes) and ref2va (references) from the prompts file, against diffusers' own modular pipeline.

One CLI render covers every case; each case's final latents are compared with diffusers 0.42.1's MiniMax-H3 modular
pipeline run on the same tiny weights, media and seed, and each MP4 is validated.
"""

import json
import wave

import av
import numpy as np
import pytest
import torch

from conftest import h3gen
from h3gen.run.validate import validate_clip

# fp32 on the CPU with diffusers' own media preparation, encoders and layout builders, and the same ops in the same
# order in the loop: the latents agree to rounding noise (the reference DiT path measured exactly equal). The fast
# DiT fuses projections and precomputes AdaLN rows, so it differs by float32 rounding (measured about 2e-7).
MAX_RELATIVE_ERROR = 1e-5
STEPS, SEED, FRAMES = 4, 11, 124
PROMPT = "a red fox runs through fresh snow at dawn"

# name -> (the prompts-file fields besides prompt/seed/id, diffusers' workflow, its inputs by file name)
CASES = {
    # 4:1 and no size given: the canvas comes from the keyframe (64x32 on the tiny model's 32 px canvas)
    "fl2va-first": ({"first_frame": "wide.png"}, "fl2va", {"image": "wide.png"}),
    "fl2va-last": ({"last_frame": "square.png", "width": 64, "height": 32}, "fl2va", {"last_image": "square.png"}),
    "fl2va-both": ({"first_frame": "square.png", "last_frame": "wide.png"}, "fl2va",
                   {"image": "square.png", "last_image": "wide.png"}),
    "ref2va-image": ({"references": ["square.png"]}, "ref2va", {"references": ["square.png"]}),
    "ref2va-video": ({"references": ["talking.mp4"]}, "ref2va", {"references": ["talking.mp4"]}),
    "ref2va-audio": ({"references": ["wide.png", "voice.wav"]}, "ref2va", {"references": ["wide.png", "voice.wav"]}),
    "ref2va-mixed": ({"references": ["voice.wav", "silent.mp4", "square.png", "talking.mp4"]}, "ref2va",
                     {"references": ["voice.wav", "silent.mp4", "square.png", "talking.mp4"]}),
}
LATENT_SIZE = {"fl2va-first": (2, 4), "fl2va-last": (2, 4), "fl2va-both": (2, 2)}


def write_image(path, width, height, seed):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def write_video(path, frames, width=48, height=32, sound=True, rate=24):
    rng = np.random.default_rng(frames)
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=rate)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = container.add_stream("aac", rate=32000, layout="stereo") if sound else None
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "rgb24")
            container.mux(video.encode(frame))
        container.mux(video.encode())
        if audio is not None:
            samples = (rng.standard_normal((2, 32000 * frames // rate)) * 0.1).astype(np.float32)
            for start in range(0, samples.shape[1], 1024):
                chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, start:start + 1024]), "fltp",
                                                   "stereo")
                chunk.sample_rate = 32000
                container.mux(audio.encode(chunk))
            container.mux(audio.encode())


def write_wav(path, seconds=1.5, rate=32000, channels=1):
    samples = (np.random.default_rng(3).standard_normal(int(seconds * rate) * channels) * 3000).astype(np.int16)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    write_image(folder / "wide.png", 128, 32, 1)
    write_image(folder / "square.png", 40, 40, 2)
    write_video(folder / "talking.mp4", 30)
    write_video(folder / "silent.mp4", 20, width=32, height=48, sound=False)
    write_wav(folder / "voice.wav")
    return folder


def prompts_for(media, cases) -> str:
    lines = [json.dumps({"id": name, "prompt": PROMPT, "seed": SEED, **CASES[name][0]}) for name in cases]
    path = media / f"prompts-{len(lines)}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def rendered(media, tiny_model, tmp_path_factory):
    """Every case in one run of the reference path: its output folder and its --json records by id."""
    out = tmp_path_factory.mktemp("tasks")
    result = h3gen("render", prompts_for(media, CASES), "-o", out, "--model", tiny_model, "--preset", "tiny", "--save-latents", "--json",
                   "--set", f"sampler.steps={STEPS}", check_code=0)
    return out, {record["id"]: record for record in map(json.loads, result.stdout.splitlines())}


@pytest.fixture(scope="module")
def diffusers_pipelines(tiny_model):
    from diffusers import ModularPipeline

    pipes = {}
    for workflow in ("fl2va", "ref2va"):
        pipes[workflow] = ModularPipeline.from_pretrained(str(tiny_model), workflow=workflow)
        pipes[workflow].load_components(dtype=torch.float32)
        pipes[workflow].set_progress_bar_config(disable=True)
    return pipes


def diffusers_latents(pipes, media, name):
    from diffusers.modular_pipelines.minimax_h3 import (MiniMaxH3AudioReference, MiniMaxH3ImageReference,
                                                        MiniMaxH3VideoReference)
    from diffusers.utils import load_image

    fields, workflow, inputs = CASES[name]
    kinds = {".png": MiniMaxH3ImageReference, ".mp4": MiniMaxH3VideoReference, ".wav": MiniMaxH3AudioReference}
    kwargs = {key: load_image(str(media / value)) for key, value in inputs.items() if key != "references"}
    if "references" in inputs:
        kwargs["references"] = [kinds[(media / file).suffix].from_file(str(media / file))
                                for file in inputs["references"]]
    if "width" in fields:  # otherwise diffusers resolves the canvas itself, from the keyframe or at 16:9
        kwargs.update(width=fields["width"], height=fields["height"])
    elif workflow == "ref2va":
        kwargs.update(width=32, height=32)
    return pipes[workflow](prompt=PROMPT, num_frames=FRAMES, num_inference_steps=STEPS,
                           generator=torch.Generator().manual_seed(SEED), output=["latents", "audio_latents"],
                           **kwargs)


def relative_error(ours, reference) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("name", list(CASES))
def test_final_latents_match_diffusers_and_the_clip_validates(name, rendered, media, diffusers_pipelines):
    from safetensors.torch import load_file

    out, records = rendered
    assert records[name]["ok"] and "conditions" in records[name]["seconds"]
    assert validate_clip(out / f"{name}.mp4", expected_frames=FRAMES) == []
    ours = load_file(str(out / f"{name}.latents.safetensors"))
    reference = diffusers_latents(diffusers_pipelines, media, name)
    assert ours["video"].shape == reference["latents"].shape == (1, 24, 37, *LATENT_SIZE.get(name, (2, 2)))
    assert ours["audio"].shape == reference["audio_latents"].shape == (2, 32, 207)
    assert relative_error(ours["video"], reference["latents"]) < MAX_RELATIVE_ERROR
    assert relative_error(ours["audio"], reference["audio_latents"]) < MAX_RELATIVE_ERROR


def test_fast_dit_runs_both_conditioned_layouts(rendered, media, tiny_model, tmp_path):
    """h3gen's DiT (fused weights, AdaLN tables with the conditioning levels) against the reference path's latents."""
    from safetensors.torch import load_file

    cases = ["fl2va-both", "ref2va-mixed"]
    h3gen("render", prompts_for(media, cases), "-o", tmp_path, "--model", tiny_model, "--preset", "tiny", "--save-latents",
          "--set", f"sampler.steps={STEPS}", "--set", 'sampler.dit="h3gen"', check_code=0)
    for name in cases:
        fast, reference = (load_file(str(folder / f"{name}.latents.safetensors")) for folder in (tmp_path, rendered[0]))
        for key in ("video", "audio"):
            assert relative_error(fast[key], reference[key]) < MAX_RELATIVE_ERROR


def test_tiny_model_has_its_own_ref2va_partition(tiny_model):
    from safetensors.torch import load_file

    weights = [load_file(str(tiny_model / folder / "diffusion_pytorch_model.safetensors"))
               for folder in ("transformer", "transformer_ref")]
    assert weights[0].keys() == weights[1].keys()
    assert not torch.equal(weights[0]["proj_out.weight"], weights[1]["proj_out.weight"])
