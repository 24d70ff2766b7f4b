"""h3gen's own stages and presets, registered through the same hooks as any plugin."""

from importlib.resources import files

from h3gen.plugins.hookspecs import hookimpl


@hookimpl
def h3gen_register_stages(register):
    from h3gen.stages.cache import NoCache, ResidualCache, ScheduleCache
    from h3gen.stages.diffusers_baseline import DiffusersDecode, DiffusersEncode, DiffusersSampler
    from h3gen.stages.encode import Qwen3VLEncoder
    from h3gen.stages.mux import PyAVMux
    from h3gen.stages.quant import FP8Rowwise, Int8WeightOnly, NoQuant
    from h3gen.stages.sampler import EulerSampler
    from h3gen.stages.vae import FastVAE, ReferenceVAE

    for stage in (Qwen3VLEncoder, EulerSampler, ReferenceVAE, FastVAE, NoQuant, FP8Rowwise, Int8WeightOnly, PyAVMux,
                  NoCache, ResidualCache, ScheduleCache, DiffusersEncode, DiffusersSampler, DiffusersDecode):
        register(stage)


@hookimpl
def h3gen_register_presets(register):
    for preset in sorted(files("h3gen.presets").iterdir(), key=lambda p: p.name):
        if preset.name.endswith(".toml"):
            register(preset)
