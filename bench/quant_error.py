"""Each quant mode against the unquantized reference on the same DiT weights and inputs: velocity error, memory, time.

Usage (h3gen installed, e.g. as in bench/offline.sh):
    python3 bench/quant_error.py [--modes fp8-rowwise,int8-weight-only] [--random-weights full|tiny | --model DIR]
                                 [--size 1344x768] [--duration 5] [--text-tokens 256] [--sigmas 0.5]
                                 [--dit diffusers|h3gen] [--set skip=[]] [--encoder] [--repeat 2]
A mode may name an attention backend for h3gen's DiT after an @: `none@triton-fp8` is FP8 attention on the
checkpoint's linears, `fp8-rowwise@cudnn-fp8` both in FP8 (the reference keeps --attention, default auto).
For each mode the DiT is loaded afresh (random weights are seeded, so every load is the same model), transformed
by the quant stage (quantized on the device, module by module), and run on the same probe as the reference.
Reported per mode and noise level: video / audio / overall relative error and cosine similarity, DiT weight GiB,
seconds to quantize, seconds per forward (last of --repeat), peak GiB. With --encoder, the text encoder's hidden
state 50 is compared the same way on random tokens. Random weights are not trained weights: the error on a real
checkpoint (--model) is the number that matters. Results: $OUT/quant_error.json (or --json PATH), written as it goes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch





def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="fp8-rowwise,int8-weight-only")
    parser.add_argument("--model", help="a MiniMax-H3 repository (default: full-size random weights)")
    parser.add_argument("--random-weights", choices=("full", "tiny"), default="full")
    parser.add_argument("--size", default="1344x768")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--text-tokens", type=int, default=256)
    parser.add_argument("--sigmas", default="0.5", help="noise levels of the probes, comma separated")
    parser.add_argument("--dit", choices=("diffusers", "h3gen"), default="diffusers",
                        help="diffusers' transformer, or h3gen's fast DiT (fused QKV, AdaLN tables) as h3-base runs it")
    parser.add_argument("--attention", default="auto", help="the reference's attention backend (h3gen DiT)")
    parser.add_argument("--set", action="append", default=[], dest="knobs", help="quant knob, e.g. skip=[]")
    parser.add_argument("--encoder", action="store_true", help="also compare the text encoder")
    parser.add_argument("--repeat", type=int, default=1, help="forwards per probe; the last one is timed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=str(Path(os.environ.get("OUT", ".")) / "quant_error.json"))
    return parser.parse_args()


def weights_source(args):
    from h3gen.models.repo import ModelRepo

    if args.model:
        return ModelRepo(args.model)
    from h3gen.models.tiny import ensure_tiny_model

    if args.random_weights == "tiny":
        return ModelRepo(ensure_tiny_model())
    from h3gen.bench.random_weights import FullSizeRandom

    # The tiny model only lends its tokenizer to the full-size text encoder: the DiT alone does not need it.
    return FullSizeRandom(ModelRepo(ensure_tiny_model()) if args.encoder else None)


def load_dit(source, args, dtype, sigmas, attention):
    if args.dit == "h3gen":
        from h3gen.models.dit.transformer import FastH3Transformer

        return source.load("transformer", FastH3Transformer, dtype=dtype, device=args.device,
                           adaln_timesteps=sorted({1.0 - s for s in sigmas}), use_triton=args.device != "cpu",
                           attention_backend=attention)
    if attention != "auto":
        raise SystemExit("an attention backend per mode needs --dit h3gen")
    from diffusers import MiniMaxH3Transformer3DModel

    return source.load("transformer", MiniMaxH3Transformer3DModel, torch_dtype=dtype, device_map=args.device).eval()


def quant_stage(mode, knobs, device, dtype):
    from types import SimpleNamespace

    from h3gen.config.preset import parse_override
    from h3gen.config.stage_config import build_config
    from h3gen.stages.quant import FP8Rowwise, Int8WeightOnly, NoQuant

    stages = {stage.name: stage for stage in (NoQuant, FP8Rowwise, Int8WeightOnly)}
    values = {key: value for _, key, value in (parse_override(f"quant.{knob}") for knob in knobs)}
    stage = stages[mode](build_config(stages[mode].Config, values, "--set"), SimpleNamespace(device=device, dtype=dtype))
    stage.load(None)
    return stage


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device):
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device):
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None


def timed_velocities(dit, probes, args, dtype):
    from h3gen.bench.velocity_error import velocity

    out, seconds = [], None
    for probe in probes:
        for _ in range(args.repeat):
            sync(args.device)
            began = time.perf_counter()
            result = velocity(dit, probe, args.device, dtype)
            sync(args.device)
            seconds = time.perf_counter() - began
        out.append(result)
    return out, round(seconds, 3)


def dit_rows(args, source, modes, dtype, log):
    from h3gen.inputs.request import Request, frames_for_duration
    from h3gen.bench.velocity_error import compare, make_probe, weight_bytes

    width, height = (int(v) for v in args.size.lower().split("x"))
    request = Request(index=0, prompt="probe", seed=1101, width=width, height=height,
                      frames=frames_for_duration(args.duration))
    sigmas = [float(s) for s in args.sigmas.split(",")]
    reference = None
    for mode in ["reference"] + modes:
        free(args.device)
        quant, _, attention = mode.partition("@")
        dit = load_dit(source, args, dtype, sigmas, attention or args.attention)
        probes = [make_probe(dit.config, request, args.text_tokens, sigma) for sigma in sigmas]
        began = time.perf_counter()
        if quant != "reference":
            dit = quant_stage(quant, args.knobs, args.device, dtype).transform("dit", dit)
            sync(args.device)
        quantize_s = round(time.perf_counter() - began, 2)
        velocities, forward_s = timed_velocities(dit, probes, args, dtype)
        row = dict(component="dit", dit=args.dit, mode=mode, knobs=args.knobs,
                   attention=getattr(dit, "attention_used", lambda: "sdpa")(),
                   rows=int(probes[0].tensors["token_tags"].numel()),
                   weight_gib=round(weight_bytes(dit) / 2**30, 2), quantize_s=quantize_s, forward_s=forward_s,
                   peak_gib=peak_gib(args.device))
        if reference is None:
            reference = velocities
        else:
            row["error"] = {f"sigma {s:g}": compare(r, v) for s, r, v in zip(sigmas, reference, velocities)}
        log(row)
        del dit


def encoder_rows(args, source, modes, dtype, log):
    from transformers import Qwen3VLForConditionalGeneration

    from h3gen.bench.velocity_error import weight_bytes

    vocab = source.text_encoder_config().text_config.vocab_size
    tokens = torch.randint(0, vocab, (1, args.text_tokens), generator=torch.Generator("cpu").manual_seed(1101))
    reference = None
    for mode in ["reference"] + modes:
        free(args.device)
        config = source.text_encoder_config()
        config.text_config.num_hidden_layers = 51  # H3 reads hidden state 50, as the encode stage loads it
        model = source.load("text_encoder", Qwen3VLForConditionalGeneration, config=config, dtype=dtype,
                            device_map=args.device).eval()
        if mode != "reference":
            model = quant_stage(mode, args.knobs, args.device, dtype).transform("text_encoder", model)
        with torch.inference_mode():
            hidden = model(input_ids=tokens.to(args.device), output_hidden_states=True).hidden_states[50]
        hidden = hidden.float().cpu().flatten().double()
        row = dict(component="text_encoder", mode=mode, weight_gib=round(weight_bytes(model) / 2**30, 2),
                   peak_gib=peak_gib(args.device))
        if reference is None:
            reference = hidden
        else:
            row["error"] = dict(rel_err=float((hidden - reference).norm() / reference.norm()),
                                cosine=float(torch.nn.functional.cosine_similarity(hidden, reference, dim=0)))
        log(row)
        del model


def main():
    args = parse_args()
    from h3gen.run.quiet import quiet_libraries

    quiet_libraries()
    dtype = getattr(torch, args.dtype)
    modes = [m for m in args.modes.split(",") if m]
    results = dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                   torch=torch.__version__, args=vars(args), rows=[])
    path = Path(args.json)

    def log(row):
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))

    source = weights_source(args)
    dit_rows(args, source, modes, dtype, log)
    if args.encoder:
        encoder_rows(args, source, modes, dtype, log)


if __name__ == "__main__":
    main()
