"""Diagnostic: where a prompt's encoding spends its time, on the device or in launching its kernels.

Encodes the bench's prompts (`--tokens` each) one at a time as the encode stage does, and times each: the wall
time, the kernels' own time on the device (CUDA profiler) and how many kernels ran. A wall time far above the
kernels' time means the encoder waits on its host thread, not on the GPU. The same prompts are then encoded
together, as one batch of equal-length rows, to show what one forward for several prompts costs and whether each
prompt's hidden state is the same bits as its own forward's.

    python3 bench/encode_probe.py [--preset fasth3-fp8] [--prompts 4] [--repeat 3] [-o encode.json]
    python3 bench/encode_probe.py --preset tiny --tiny --prompts 2 --repeat 1   # on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    import torch

    from h3gen.bench.batch import batch_requests
    from h3gen.bench.sweep import BenchPlan, add_probe_options, probe_renderer

    parser = argparse.ArgumentParser()
    add_probe_options(parser)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("-o", "--output", type=Path, default=Path("encode.json"))
    args = parser.parse_args()

    renderer = probe_renderer(args.preset, 1, args.set, args.tiny)
    encode = renderer.stages["encode"]
    plan = BenchPlan(presets=[args.preset], text_tokens=args.tokens)
    prompts = [encode.prompt_tokens(r.prompt) for r in batch_requests(plan, 10.0, args.prompts)]
    cuda = renderer.runtime.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    encode.hidden_state(prompts[0], {})  # loads and warms the encoder

    def timed(call) -> tuple[float, object]:
        sync()
        began = time.perf_counter()
        out = call()
        sync()
        return time.perf_counter() - began, out

    def kernels(call) -> tuple[float, int]:
        """The device's kernel time and kernel count for `call` (0, 0 on the CPU)."""
        if not cuda:
            return 0.0, 0
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            sync()
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        return sum(e.device_time for e in events) / 1e6, len(events)

    singles, outputs = [], []
    for _ in range(args.repeat):
        for tokens in prompts:
            seconds, out = timed(lambda t=tokens: encode.hidden_state(t, {}))
            singles.append(seconds)
            outputs.append(out)
    outputs = outputs[:len(prompts)]
    single_kernel_s, single_kernels = kernels(lambda: encode.hidden_state(prompts[0], {}))

    text_encoder = encode.text_encoder

    def batched():
        ids = torch.tensor(prompts, dtype=torch.long, device=renderer.runtime.device)
        types = torch.tensor(encode.processor.create_mm_token_type_ids(prompts), dtype=torch.long, device=ids.device)
        with torch.inference_mode():
            hidden = text_encoder.model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                                        use_cache=False, output_hidden_states=True).hidden_states[encode.config.layer]
        return hidden.to(renderer.runtime.dtype)

    batch_runs = [timed(batched) for _ in range(args.repeat)]
    batch_kernel_s, batch_kernels = kernels(batched)
    together = batch_runs[-1][1]
    diffs = [(together[i:i + 1].float() - outputs[i].float()).abs().max().item() for i in range(len(prompts))]
    report = dict(
        preset=renderer.preset.name, prompts=len(prompts), tokens=args.tokens, repeat=args.repeat,
        one_prompt=dict(wall_s=round(statistics.median(singles), 4), walls=[round(s, 4) for s in singles],
                        kernel_s=round(single_kernel_s, 4), kernels=single_kernels),
        together=dict(wall_s=round(statistics.median(s for s, _ in batch_runs), 4), kernel_s=round(batch_kernel_s, 4),
                      kernels=batch_kernels, max_abs_vs_one_prompt=diffs,
                      same_bits=all(torch.equal(together[i:i + 1], outputs[i]) for i in range(len(prompts)))),
        device=torch.cuda.get_device_name() if cuda else "cpu")
    renderer.close()
    print(json.dumps(report, indent=1))
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
