"""diffusers' group offloading (block level, the copies on a side stream) where h3gen uses it.

A text encoder larger than the device's room for it: Qwen3-VL's language layers kept in host memory and brought
to the device one at a time as they run.

The encoder runs once per prompt, before the DiT needs the memory its activations take, so its layers pass through
what the DiT's forward leaves free. Each layer is quantized on the device as it is first placed, then goes back to
host memory: the quantized weights are what stream.
"""

from __future__ import annotations

LAYERS = "model.language_model.layers"  # Qwen3VLForConditionalGeneration's decoder layers
GROUPED = ["model", "language_model"]  # the path down to them, for group offloading's block level


def stream_text_encoder(encoder, runtime):
    """`encoder` loaded in host memory, its layers quantized one by one on `runtime.device` and streamed from
    then on; what is not a layer (embeddings, vision tower, norms) comes to the device as each forward needs it."""
    import torch
    from diffusers.hooks import apply_group_offloading

    device = torch.device(runtime.device)
    for index, layer in enumerate(encoder.get_submodule(LAYERS)):
        layer.to(device)
        runtime.quantize_part("text_encoder", layer, f"{LAYERS}.{index}")
        layer.to("cpu")
    encoder = runtime.quantize("text_encoder", encoder)
    apply_group_offloading(encoder, onload_device=device, offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=device.type == "cuda",
                           block_modules=GROUPED)
    return encoder


def group_offload_blocks(dit, device: str) -> None:
    """h3gen's DiT with every block (and the rest of it) offloaded by group offloading instead of h3gen's own
    streamer (`sampler.stream_with = "diffusers"`): the comparison the README's memory section reports."""
    import torch
    from diffusers.hooks import apply_group_offloading

    device = torch.device(device)
    apply_group_offloading(dit, onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                           num_blocks_per_group=1, use_stream=device.type == "cuda")
