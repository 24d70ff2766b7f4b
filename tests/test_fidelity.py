"""h3gen's reference path against diffusers' own MiniMax-H3 modular pipeline, on the same tiny weights."""

import pytest
import torch
from diffusers import ModularPipeline

from conftest import h3gen, media

# fp32 on the CPU with the same ops in the same order: the latents should agree to rounding noise.
MAX_RELATIVE_ERROR = 1e-5


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def diffusers_latents(model_dir, prompt, seed, frames, steps):
    pipe = ModularPipeline.from_pretrained(str(model_dir), workflow="t2va")
    pipe.load_components(torch_dtype=torch.float32)
    return pipe(prompt=prompt, height=32, width=32, num_frames=frames, num_inference_steps=steps,
                generator=torch.Generator().manual_seed(seed), output=["latents", "audio_latents"])


def test_final_latents_match_diffusers_modular_pipeline(tiny_model, prompts_file, tmp_path):
    from safetensors.torch import load_file

    prompt = "a red fox runs through fresh snow at dawn"
    prompts = prompts_file(f'{{"id": "fox", "prompt": "{prompt}", "seed": 1101}}\n')
    h3gen("render", prompts, "-o", tmp_path / "out", "--model", tiny_model, "--preset", "tiny", "--save-latents",
          "--set", "sampler.steps=5", check_code=0)
    ours = load_file(str(tmp_path / "out" / "fox.latents.safetensors"))
    reference = diffusers_latents(tiny_model, prompt, seed=1101, frames=124, steps=5)
    assert ours["video"].shape == reference["latents"].shape == (1, 24, 37, 2, 2)
    assert ours["audio"].shape == reference["audio_latents"].shape == (2, 32, 207)
    assert relative_error(ours["video"], reference["latents"]) < MAX_RELATIVE_ERROR
    assert relative_error(ours["audio"], reference["audio_latents"]) < MAX_RELATIVE_ERROR


def test_explicit_sigma_positions_are_shifted_per_modality():
    from h3gen.stages.sampler import EulerConfig, sigma_schedule

    config = EulerConfig(sigma_positions=[0.999, 0.749, 0.5, 0.25, 0.0])
    video, audio = sigma_schedule(config, 12.0), sigma_schedule(config, 3.0)
    assert len(video.timesteps) == len(audio.timesteps) == 4
    expected = torch.tensor([12 * p / (1 + 11 * p) for p in (0.999, 0.749, 0.5, 0.25, 0.0)])
    torch.testing.assert_close(video.sigmas.cpu(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(audio.sigmas[1].item(), 3 * 0.749 / (1 + 2 * 0.749), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("steps, positions", [(50, []), (5, []), (1000, []), (50, [0.999, 0.75, 0.5, 0.25, 0.0])])
def test_a_grid_refused_at_validation_is_exactly_one_the_scheduler_would_shorten_or_break(steps, positions):
    """`grid_problem` checks the shift without diffusers (a dry run does not import it); here it answers as
    diffusers' scheduler does: a full count of finite, distinct, increasing timesteps that it can look up."""
    from h3gen.stages.sampler import EulerConfig, forwards, grid_problem, sigma_schedule

    config = EulerConfig(steps=steps, sigma_positions=positions)
    for shift in (1e-12, 1e-10, 1e-7, 1e-5, 1e-3, 0.1, 1.0, 3.0, 12.0, 1e3, 1e5, 1e6, 1e7, 1e8, 1e30, 1e300):
        try:
            schedule = sigma_schedule(config, shift)
            t = schedule.timesteps
            whole = (len(t) == forwards(config) and bool(torch.isfinite(t).all()) and bool((t[1:] > t[:-1]).all())
                     and [schedule.index_for_timestep(x) for x in t] == list(range(len(t))))
        except ValueError:
            whole = False
        assert whole == (grid_problem(config, shift) == ""), (steps, positions, shift)


def test_reference_preset_writes_the_same_mp4_as_the_diffusers_baseline(tiny_model, prompts_file, tmp_path):
    """The whole clip, not just the latents: h3gen's stages and diffusers' blocks give the same bytes."""
    prompts = prompts_file('{"id": "clip", "prompt": "rain on a tin roof", "seed": 42}\n')
    h3gen("render", prompts, "-o", tmp_path / "ours", "--model", tiny_model, "--preset", "tiny", check_code=0)
    h3gen("render", prompts, "-o", tmp_path / "diffusers", "--model", tiny_model, "--preset", "diffusers",
          "--set", "model.needs=any", "--set", "request.width=32", "--set", "request.height=32", "--set", 'runtime.dtype="float32"',
          "--set", "sampler.steps=4", check_code=0)
    assert media(tmp_path / "ours/clip.mp4") == media(tmp_path / "diffusers/clip.mp4")


def test_h3gen_dit_render_matches_the_reference_render(tiny_model, prompts_file, tmp_path):
    """The fast DiT (fused projections, AdaLN tables; CPU falls back to its torch ops) in a whole render."""
    from safetensors.torch import load_file

    prompts = prompts_file('{"id": "clip", "prompt": "a kite over a beach", "seed": 9}\n')
    for name, dit, exact_norms in (("reference", "diffusers", "false"), ("fast", "h3gen", "false"),
                                   ("exact", "h3gen", "true")):
        h3gen("render", prompts, "-o", tmp_path / name, "--model", tiny_model, "--preset", "tiny", "--save-latents",
              "--set", f'sampler.dit="{dit}"', "--set", f"sampler.exact_norms={exact_norms}", check_code=0)
    reference = load_file(str(tmp_path / "reference" / "clip.latents.safetensors"))
    for name in ("fast", "exact"):
        ours = load_file(str(tmp_path / name / "clip.latents.safetensors"))
        for key in ("video", "audio"):
            assert relative_error(ours[key], reference[key]) < MAX_RELATIVE_ERROR


def test_exact_preset_writes_the_same_mp4_as_the_reference_preset(tiny_model, prompts_file, tmp_path):
    """`h3-exact` (h3gen's DiT with AdaLN tables and kernels given torch's norm statistics, the fused decoder) against
    `h3-reference` (diffusers' transformer and decode), both in bf16: the same bytes. On the CPU the kernels run as
    their torch references; on an H200 the full-size parity is bench/dit_gpu_check.py's and vae_gpu_check.py's."""
    prompts = prompts_file('{"id": "clip", "prompt": "rain on a tin roof", "seed": 42}\n')
    small = ["--set", "model.needs=any", "--set", "request.width=32", "--set", "request.height=32", "--set", "sampler.steps=4"]
    for preset in ("h3-exact", "h3-reference"):
        h3gen("render", prompts, "-o", tmp_path / preset, "--model", tiny_model, "--preset", preset, *small,
              check_code=0)
    assert media(tmp_path / "h3-exact/clip.mp4") == media(tmp_path / "h3-reference/clip.mp4")
