"""Which FP8 linears cost a DiT block its accuracy: one full-width block, each set of projections kept unquantized.

Usage (h3gen installed; runs on the CPU in a few minutes, or on a GPU):
    python3 bench/fp8_block_error.py [--size 384x384] [--duration 2] [--text-tokens 64] [-o fp8_block_error.json]
Builds MiniMax-H3's DiT at full width (hidden 5376, 56 heads of 128, SwiGLU 14336) with one block and one refiner
block, random weights as `bench/dit_gpu_check.py` draws them (linears N(0, 0.02), norm weights N(1, 0.1)), in fp32.
A forward over a small t2va layout captures the first block's input and output; then the block is run with its
linears quantized by the fp8-rowwise quant stage's linear (the dequantizing reference: the values `_scaled_mm`
computes, up to its accumulation order) for each `skip` set, and its output compared with the unquantized one
(relative L2 error, cosine similarity). The full-size check (`dit_gpu_check.py`, the 10 s layout) measures the same
block against diffusers' bf16 block: FP8 error plus bf16's own.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dit_gpu_check as check  # noqa: E402

SKIPS = {"none": [], "to_qkv": ["to_qkv"], "to_out": ["to_out"], "up_gate": ["up_gate"], "down": ["down"],
         "to_out+down": ["to_out", "down"], "attention (to_qkv+to_out)": ["to_qkv", "to_out"],
         "feed-forward (up_gate+down)": ["up_gate", "down"]}


def build_reference(folder: Path):
    """diffusers' DiT at full width, one block, random weights, saved as a `transformer/` folder."""
    from diffusers import MiniMaxH3Transformer3DModel

    config = check.full_size_config() | dict(num_layers=1, num_refiner_layers=1)
    model = MiniMaxH3Transformer3DModel(**config)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            check.draw_random_(param, name, g)
    model.save_pretrained(folder)
    return config


def capture_block(model, inputs):
    """(input, output) of the first block in one forward."""
    captured = {}
    hook = model.transformer_blocks[0].register_forward_hook(
        lambda module, args, out: captured.update(args=args, out=out))
    model(**inputs)
    hook.remove()
    return captured["args"], captured["out"]


def similarity(actual, expected):
    a, e = actual.double().flatten(), expected.double().flatten()
    return float((a - e).norm() / e.norm()), float(torch.nn.functional.cosine_similarity(a, e, dim=0))


def main():
    from h3gen.inputs.request import Request
    from h3gen.bench.velocity_error import make_probe
    from h3gen.models.dit.transformer import FastH3Transformer
    from h3gen.models.quant_linear import FP8RowwiseLinear, swap_linears

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="384x384")
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("-o", "--output", default="fp8_block_error.json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    width, height = (int(v) for v in args.size.split("x"))
    frames = 17 * round((args.duration * 24 - 5) / 17) + 5
    results = {"size": args.size, "frames": frames, "variants": {}}
    with tempfile.TemporaryDirectory() as folder:
        config = build_reference(Path(folder))
        probe = make_probe(config, Request(index=0, prompt="", seed=0, width=width, height=height, frames=frames),
                           args.text_tokens, sigma=0.5)
        inputs = probe.inputs("cpu", torch.float32)
        model = FastH3Transformer.from_pretrained(folder, dtype=torch.float32, use_triton=False, adaln_table=False)
    results["rows"] = int(inputs["position_ids"].shape[0])
    block_args, expected = capture_block(model, inputs)
    print(f"{results['rows']} packed rows; block output norm {float(expected.norm()):.3f}", flush=True)
    block = model.transformer_blocks[0]
    for name, skip in SKIPS.items():
        quantized = copy.deepcopy(block)
        swap_linears(quantized, lambda linear: FP8RowwiseLinear.from_linear(linear, matmul="reference"),
                     ("attn", "ff"), skip)
        began = time.perf_counter()
        rel_err, cos = similarity(quantized(*block_args), expected)
        results["variants"][name] = dict(skip=skip, rel_err=rel_err, cos=cos)
        print(f"{name:30s} rel err {rel_err:.3e}  cos {cos:.6f}  ({time.perf_counter() - began:.1f} s)", flush=True)
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
