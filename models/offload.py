"""diffusers' group offloading (block level, the copies on a side stream) where h3gen uses it.

A text encoder larger than the device's room for it: Qwen3-VL's language layers kept in host memory and brought
to the device one at a time as they run.

The encoder runs once per prompt, before the DiT needs the memory its activations take, so its layers pass through
what the DiT's forward leaves free. Each layer is quantized on the device as it is first placed, then goes back to
host memory: the quantized weights are what stream.
"""

from __future__ import annotations

LANGUAGE = "model.language_model"  # Qwen3VLForConditionalGeneration's language stack: its decoder layers stream


def stream_text_encoder(encoder, runtime):
    """`encoder` loaded in host memory, its layers quantized one by one on `runtime.device` and streamed from
    then on (the stack's final norm comes to the device as each forward starts); the token embeddings, the vision
    tower and the head resident on the device. Group offloading is applied to the language stack alone: its hooks, with
    a side stream, cannot nest (one per level would track the same layers twice)."""
    import torch
    from diffusers.hooks import apply_group_offloading

    device = torch.device(runtime.device)
    language = encoder.get_submodule(LANGUAGE)
    for index, layer in enumerate(language.layers):
        layer.to(device)
        runtime.quantize_part("text_encoder", layer, f"{LANGUAGE}.layers.{index}")
        layer.to("cpu")
    streamed = {id(tensor) for tensor in (*language.parameters(), *language.buffers())}
    for module in encoder.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is not None and id(tensor) not in streamed:
                    moved = tensor.data.to(device)
                    if kind == "_parameters":
                        tensor.data = moved
                    else:
                        module._buffers[name] = moved
    encoder = runtime.quantize("text_encoder", encoder)
    # The token embeddings stay resident: Qwen3VLModel embeds the tokens before the language stack's forward,
    # whose hooks would bring them over. Out of the stack while the hooks are applied, they belong to no group.
    embed = language.embed_tokens.to(device)
    language.embed_tokens = torch.nn.Identity()
    apply_group_offloading(language, onload_device=device, offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=device.type == "cuda")
    language.embed_tokens = embed
    return encoder


def group_offload_blocks(dit, device: str) -> None:
    """h3gen's DiT with every block (and the rest of it) offloaded by group offloading instead of h3gen's own
    streamer (`sampler.stream_with = "diffusers"`): the comparison the README's memory section reports."""
    import torch
    from diffusers.hooks import apply_group_offloading

    device = torch.device(device)
    apply_group_offloading(dit, onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                           num_blocks_per_group=1, use_stream=device.type == "cuda")
