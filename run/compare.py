"""`h3gen compare`: how far one clip is from another, for judging a fast preset (a step cache, FP8) against the
reference path on your own weights. Video: PSNR and SSIM per frame (torchmetrics), their mean and worst frame.
Audio: SNR of one soundtrack against the other, and the mean distance of their log-mel spectrograms in dB
(transformers' audio features). The second clip is the reference: `compare FAST REFERENCE`.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from h3gen.errors import UsageError

# Pixels compared at once: torchmetrics' SSIM convolves five planes of every channel with an 11x11 window. For one
# 1344x768 frame on the CPU the process peaked at 1.6 GB resident and took 0.44 s in float32, 6 GB and 9.3 s in
# float64, for SSIM values 7e-8 apart; eight such frames at once in float64 asked for 40 GB.
PIXELS_PER_PASS = 1344 * 768
MEL_FILTERS, MEL_WINDOW, MEL_HOP = 80, 1024, 256


def pairs(a: Path, b: Path) -> tuple[list[tuple[Path, Path]], list[Path]]:
    """Two MP4s, or the MP4s of two directories matched one to one (none, where they share no prompt), and the clips
    left without a match. A clip is
    matched by file name (a prompt's id), else by the request in its h3gen stamp (prompt, seed, size, frames, media),
    else by that request without the seed, each only where the match is the one candidate on both sides."""
    if a.is_dir() and b.is_dir():
        from h3gen.run.fingerprint import read_stamp
        from h3gen.run.outputs import clips_in

        left, right = clips_in(a), clips_in(b)
        matched, stamp = [], functools.cache(read_stamp)  # each clip's stamp read once for both request keys
        for key in (lambda p: p.name, request_key(stamp, seed=True), request_key(stamp, seed=False)):
            found = one_to_one(left, right, key)
            matched += found
            left = [p for p in left if p not in {x for x, _ in found}]
            right = [p for p in right if p not in {y for _, y in found}]
        return sorted(matched), left + right
    for path in (a, b):
        if not path.exists():
            raise UsageError(f"{path} does not exist", "compare two MP4s, or two directories of them")
    for path, other in ((a, b), (b, a)):
        if path.is_dir():
            raise UsageError(f"{path} is a directory and {other} a file", "compare two MP4s, or two directories of them")
    return [(a, b)], []


def request_key(stamp, seed: bool):
    """A clip's request as its stamp holds it (`stamp`: h3gen.run.fingerprint.read_stamp; None for a clip h3gen did
    not stamp)."""
    def key(path: Path):
        fields = stamp(path)
        if fields is None:
            return None
        request = {k: v for k, v in fields.items() if k.startswith("request.") and (seed or k != "request.seed")}
        return json.dumps(request, sort_keys=True)
    return key


def one_to_one(left: list[Path], right: list[Path], key) -> list[tuple[Path, Path]]:
    """The pairs whose key is the same and held by no other clip on either side."""
    def unique(paths):
        keys = {}
        for path in paths:
            keys.setdefault(key(path), []).append(path)
        return {k: v[0] for k, v in keys.items() if k is not None and len(v) == 1}

    ours, theirs = unique(left), unique(right)
    return [(ours[k], theirs[k]) for k in ours.keys() & theirs.keys()]


def read_clip(path: Path):
    """(uint8 frames (T, H, W, 3), float32 audio (channels, samples), sample rate), decoded with PyAV."""
    import av
    import numpy as np

    from h3gen.run.validate import QUICKTIME, box_problem, is_quicktime

    try:
        if is_quicktime(path):
            raise UsageError(f"{path} is {QUICKTIME}", "compare the MP4s h3gen writes")
        cut = box_problem(path)  # its pictures may all decode, but the file is not whole (h3gen validate: invalid)
        if cut:
            raise UsageError(f"{path}: {cut}", "compare the MP4s h3gen writes")
        with av.open(str(path)) as container:
            if "mp4" not in container.format.name or not container.streams.video:
                raise UsageError(f"{path} is not an MP4 with a video stream", "compare the MP4s h3gen writes")
            frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
            container.seek(0)
            audio, rate = [], 0
            if container.streams.audio:
                rate = container.streams.audio[0].rate
                audio = [f.to_ndarray().reshape(-1, f.samples) for f in container.decode(audio=0)]
    except (av.FFmpegError, OSError, ValueError) as e:  # a file cut short was said above; what the decoder said,
        why = getattr(e, "strerror", None) or str(e)  # without its error number
        raise UsageError(f"cannot read {path} as an MP4: {why}", "compare the MP4s h3gen writes") from None
    sound = np.concatenate(audio, axis=1).astype(np.float32) if audio else np.zeros((0, 0), np.float32)
    return frames, sound, rate


def compare(a: Path, b: Path) -> dict:
    import torch
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    (frames_a, audio_a, rate_a), (frames_b, audio_b, rate_b) = read_clip(a), read_clip(b)
    if bool(rate_a) != bool(rate_b):
        silent, other = (a, b) if not rate_a else (b, a)
        raise UsageError(f"{silent} has no audio stream, and {other} has one",
                         "compare clips rendered from the same request (size, duration)")
    size_a, size_b = (f"{frames.shape[2]}x{frames.shape[1]}" for frames in (frames_a, frames_b))
    for what, x, y in (("frame counts", len(frames_a), len(frames_b)), ("sizes", size_a, size_b),
                       ("sample rates", rate_a, rate_b), ("audio channels", audio_a.shape[0], audio_b.shape[0])):
        if x != y:
            raise UsageError(f"{a} and {b} differ in {what} ({x} and {y})",
                             "compare clips rendered from the same request (size, duration)")
    psnr, ssim = [], []
    per_pass = max(1, PIXELS_PER_PASS // (frames_a.shape[1] * frames_a.shape[2]))
    for start in range(0, len(frames_a), per_pass):
        x, y = (torch.from_numpy(f[start:start + per_pass]).permute(0, 3, 1, 2).double() for f in (frames_a, frames_b))
        psnr += peak_signal_noise_ratio(x, y, data_range=255.0, reduction="none", dim=(1, 2, 3)).tolist()
        ssim += structural_similarity_index_measure(x.float(), y.float(), data_range=255.0, reduction="none").tolist()
    return {"a": str(a), "b": str(b), "frames": len(frames_a),
            "psnr_mean": mean_psnr(psnr), "psnr_worst": min(psnr), "ssim_mean": sum(ssim) / len(ssim),
            "ssim_worst": min(ssim), **audio_distances(audio_a, audio_b, rate_a)}


def mean_psnr(values: list[float]) -> float:
    """PSNR of the clip's mean squared error, averaged over frames as MSE (identical frames do not make it inf)."""
    finite = [10 ** (-v / 10) for v in values if math.isfinite(v)]
    mse = sum(finite) / len(values)
    return math.inf if mse == 0 else -10 * math.log10(mse)


def audio_distances(a, b, rate: int) -> dict:
    import numpy as np

    if a.size == 0:
        return {"audio_snr_db": None, "log_mel_distance_db": None}
    noise = float(((a - b).astype(np.float64) ** 2).sum())
    signal = float((b.astype(np.float64) ** 2).sum())
    snr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    return {"audio_snr_db": snr, "log_mel_distance_db": float(np.abs(log_mel(a, rate) - log_mel(b, rate)).mean())}


def log_mel(audio, rate: int):
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    filters = mel_filter_bank(num_frequency_bins=MEL_WINDOW // 2 + 1, num_mel_filters=MEL_FILTERS, min_frequency=0.0,
                              max_frequency=rate / 2, sampling_rate=rate, norm="slaney", mel_scale="slaney")
    window = window_function(MEL_WINDOW, "hann")
    import numpy as np

    return np.stack([spectrogram(channel, window, MEL_WINDOW, MEL_HOP, power=2.0, mel_filters=filters, log_mel="dB")
                     for channel in audio])
