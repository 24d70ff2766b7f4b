"""The video decode split over two gloo processes gives the one-process frames exactly (tiny model, float32, CPU)."""

import numpy as np
import torch

from conftest import leave_group

# 12 latent frames (39 frames, 2 chunks) of 20x22 latents. Exact: 2x2 tiles a chunk, 8 in batches of 3, so in the
# second round the second rank has no batch and sends padding only. Fast: 128 px tiles in batches the
# ranks agree on (4 on a CPU), so 24 tiles (3x4 a chunk) in 6 batches over 3 rounds.
REQUEST = dict(index=0, prompt="p", seed=1, width=352, height=320, frames=39)
CONFIGS = {"exact": {"exact": True, "tile_batch": 3}, "fast": {"tile_height": 128, "tile_width": 128, "overlap": 32}}


def decode_clip(model_dir, config, group=None):
    from h3gen.inputs.request import Request
    from h3gen.stages.clip import Clip
    from h3gen.run.render import Runtime
    from h3gen.models.repo import ModelRepo
    from h3gen.stages.vae import FastVAE, FastVAEConfig
    from h3gen.run.timing import StageTimer

    stage = FastVAE(FastVAEConfig(**config), Runtime("cpu", torch.float32, StageTimer("cpu")))
    stage.load(ModelRepo(model_dir))
    torch.manual_seed(5)
    with torch.no_grad():  # diffusers zero-initializes these, which would leave the decoder blocks out
        for name, param in stage.vae.decoder.named_parameters():
            if "scale" in name or "register" in name:
                param.normal_(0, 0.5)
    if group is not None:
        stage.parallelize(group)
    request = Request(**REQUEST)
    clip = Clip(request=request, path=None, video_latents=torch.randn(request.video_latent_shape),
                audio_latents=torch.randn(request.audio_latent_shape))
    return stage(clip, report=False)


def rank_main(rank, world, init_file, model_dir, out_dir, threads):
    import torch.distributed as dist

    torch.set_num_threads(threads)  # the CPU's sums split by thread: the one-process decode's count, whatever the env
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    for name, config in CONFIGS.items():
        clip = decode_clip(model_dir, config, dist.group.WORLD)
        if rank == 0:
            np.save(f"{out_dir}/{name}.npy", clip.frames)
            np.save(f"{out_dir}/{name}-audio.npy", clip.audio)
        else:
            assert clip.frames is None and clip.audio is None
    leave_group()


def test_two_ranks_equal_one(tiny_model, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(2, str(tmp_path / "init"), str(tiny_model), str(tmp_path), torch.get_num_threads()),
             nprocs=2, join=True)
    for name, config in CONFIGS.items():
        alone = decode_clip(tiny_model, config)
        split = np.load(tmp_path / f"{name}.npy")
        assert split.shape == alone.frames.shape == (39, 320, 352, 3)
        assert np.array_equal(split, alone.frames), name
        assert np.array_equal(np.load(tmp_path / f"{name}-audio.npy"), alone.audio), name
