"""`h3gen compare`: a clip against itself is identical (PSNR inf, SSIM 1), two seeds give finite distances, and clips
that cannot be compared are refused in one line."""

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import h3gen


def clip(path, seed, frames=22, size=(32, 48), rate=32000, comment=""):
    from h3gen.stages.mux import write_mp4

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (frames, *size, 3), dtype=np.uint8)
    audio = (rng.standard_normal((2, int(frames / 24 * rate))) * 0.1).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_mp4(path, pixels, audio, sample_rate=rate, comment=comment)
    return path


def records(result):
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_a_clip_against_itself_and_against_another_seed(tmp_path):
    a = clip(tmp_path / "a" / "x.mp4", 1)
    clip(tmp_path / "b" / "x.mp4", 2)
    (same,) = records(h3gen("compare", a, a, "--json", check_code=0))
    assert (same["psnr_mean"], same["psnr_worst"], same["ssim_mean"], same["ssim_worst"]) == ("inf", "inf", 1.0, 1.0)
    assert same["audio_snr_db"] == "inf" and same["log_mel_distance_db"] == 0.0
    result = h3gen("compare", tmp_path / "a", tmp_path / "b", "--json", check_code=0)  # matched by file name
    (other,) = records(result)
    assert 0 < other["psnr_mean"] < 20 and other["psnr_worst"] <= other["psnr_mean"]
    assert other["ssim_worst"] <= other["ssim_mean"] < 0.5 and other["log_mel_distance_db"] > 0
    assert "PSNR dB" in result.stderr and "x.mp4" in result.stderr


def stamped(path, prompt, seed, preset):
    """A clip whose h3gen stamp holds this request: its pixels do not matter here."""
    from h3gen.run.fingerprint import stamp

    fields = {"preset": preset, "request.prompt": prompt, "request.seed": seed, "request.size": "48x32",
              "request.frames": 22}
    return clip(path, seed, comment=stamp(fields))


def test_folders_of_two_presets_are_matched_by_the_request_in_each_clip(tmp_path):
    a, b = tmp_path / "fast", tmp_path / "ref"
    stamped(a / "h3-1.mp4", "a fox", 7, "fast"), stamped(b / "h3-9.mp4", "a fox", 7, "ref")
    stamped(a / "h3-2.mp4", "an owl", 1, "fast"), stamped(b / "h3-8.mp4", "an owl", 2, "ref")  # by the prompt alone
    clip(a / "named.mp4", 3), clip(b / "named.mp4", 4)  # a prompt's id: by file name, stamped or not
    stamped(a / "h3-3.mp4", "a cat", 7, "fast")  # two candidates in ref/: neither is picked
    stamped(b / "h3-7.mp4", "a cat", 7, "ref"), stamped(b / "h3-6.mp4", "a cat", 7, "ref-again")
    clip(b / "lone.mp4", 5)
    (a / ".h3-1.mp4.partial.mp4").write_bytes(b"half a clip")  # a run still writing it: not one of the clips
    result = h3gen("compare", a, b, "--json", check_code=0)
    compared = sorted((Path(r["a"]).name, Path(r["b"]).name) for r in records(result) if r["compared"])
    assert compared == [("h3-1.mp4", "h3-9.mp4"), ("h3-2.mp4", "h3-8.mp4"), ("named.mp4", "named.mp4")]
    left_out = [(r["a"], r["b"], r["reason"]) for r in records(result) if not r["compared"]]
    reason = "no single match in the other folder"
    assert left_out == [(str(a / "h3-3.mp4"), None, reason)] + [
        (None, str(b / name), reason) for name in ("h3-6.mp4", "h3-7.mp4", "lone.mp4")]
    notes = sorted(line.split()[1] for line in result.stderr.splitlines() if line.startswith("note:"))
    assert notes == [str(a / "h3-3.mp4"), str(b / "h3-6.mp4"), str(b / "h3-7.mp4"), str(b / "lone.mp4")]
    assert "not compared" in result.stderr and "h3-1.mp4 (h3-9.mp4)" in result.stderr


def test_a_pair_of_two_folders_that_cannot_be_compared_is_left_out_with_a_note(tmp_path):
    """One pair differs in frame count: the other pairs are compared, the table drawn, and the exit is 1."""
    a, b = tmp_path / "a", tmp_path / "b"
    clip(a / "same.mp4", 1), clip(b / "same.mp4", 2)
    clip(a / "longer.mp4", 1), clip(b / "longer.mp4", 1, frames=39)
    result = h3gen("compare", a, b, "--json", check_code=1)
    assert [(Path(r["a"]).name, r["compared"]) for r in records(result)] == [("same.mp4", True), ("longer.mp4", False)]
    assert records(result)[1] == {"a": str(a / "longer.mp4"), "b": str(b / "longer.mp4"), "compared": False,
                                  "reason": f"{a / 'longer.mp4'} and {b / 'longer.mp4'} differ in frame counts (22 "
                                            "and 39)"}
    assert (f"note: {a / 'longer.mp4'} and {b / 'longer.mp4'} differ in frame counts (22 and 39); not compared"
            in result.stderr)
    assert "same.mp4" in result.stderr  # the table


def test_a_clip_cut_short_in_a_folder_is_refused_not_passed_over_as_unmatched(tmp_path):
    """Its stamp cannot be read to match it: named with what is wrong, as `h3gen validate` names it, and the exit is 1."""
    a, b = tmp_path / "a", tmp_path / "b"
    clip(a / "same.mp4", 1), clip(b / "same.mp4", 2)
    whole = clip(tmp_path / "whole.mp4", 3).read_bytes()
    (a / "h3-cut.mp4").write_bytes(whole[:-100])
    result = h3gen("compare", a, b, "--json", check_code=1)
    (left_out,) = [r for r in records(result) if not r["compared"]]
    assert left_out["a"] == str(a / "h3-cut.mp4") and left_out["reason"].startswith("truncated"), left_out
    assert f"note: {a / 'h3-cut.mp4'}: truncated" in result.stderr and "; not compared" in result.stderr


def test_folders_without_one_match_are_refused(tmp_path):
    stamped(tmp_path / "a" / "h3-1.mp4", "a fox", 7, "fast"), stamped(tmp_path / "b" / "h3-2.mp4", "a cat", 7, "ref")
    result = h3gen("compare", tmp_path / "a", tmp_path / "b", "--json", check_code=2)
    assert result.stderr.splitlines() == [  # one line: the clips are not each a note of their own
        f"h3gen: error: {tmp_path / 'a'} and {tmp_path / 'b'} hold no MP4s of the same prompts: none of their 2 clips "
        "matches one in the other folder by file name, by prompt, seed, size and frames, or by those but the seed "
        "(compare folders rendered from one prompts file)"]
    # --json still says what was left out, as where some pairs match
    assert [json.loads(line) for line in result.stdout.splitlines()] == [
        {"a": str(tmp_path / "a" / "h3-1.mp4"), "b": None, "compared": False,
         "reason": "no single match in the other folder"},
        {"a": None, "b": str(tmp_path / "b" / "h3-2.mp4"), "compared": False,
         "reason": "no single match in the other folder"}]


@pytest.mark.parametrize("other, message", [
    (dict(frames=39), "differ in frame counts (22 and 39)"),
    (dict(size=(64, 48)), "differ in sizes (48x32 and 48x64)"),
    (dict(rate=16000), "differ in sample rates (32000 and 16000)"),
])
def test_clips_that_cannot_be_compared_are_refused(tmp_path, other, message):
    a, b = clip(tmp_path / "a.mp4", 1), clip(tmp_path / "b.mp4", 1, **other)
    result = h3gen("compare", a, b, check_code=2)
    assert result.stderr.count("\n") == 1 and message in result.stderr


def test_a_file_that_is_not_an_mp4_is_refused(tmp_path):
    text = tmp_path / "notes.mp4"
    text.write_text("not a video\n")
    result = h3gen("compare", text, clip(tmp_path / "a.mp4", 1), check_code=2)
    assert result.stderr == (f"h3gen: error: {text}: not an MP4 (it does not start with an ftyp box) (compare the MP4s "
                             "h3gen writes)\n")


def test_a_quicktime_movie_is_refused_as_validate_refuses_it(tmp_path):
    a = clip(tmp_path / "a.mp4", 1)
    movie = tmp_path / "movie.mp4"
    data = bytearray(a.read_bytes())
    data[8:12] = b"qt  "  # the ftyp box's major brand: QuickTime's
    movie.write_bytes(bytes(data))
    result = h3gen("compare", movie, a, check_code=2)
    assert result.stderr == (f"h3gen: error: {movie} is a QuickTime movie (brand 'qt  '), not an MP4 (compare the MP4s "
                             "h3gen writes)\n")


def test_a_clip_without_sound_and_a_cut_short_one_are_said_as_such(tmp_path):
    import av

    silent = tmp_path / "silent.mp4"
    with av.open(str(silent), "w") as container:  # video alone, as another tool may write it
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 48, 32, "yuv420p"
        for i in range(22):
            frame = av.VideoFrame.from_ndarray(np.full((32, 48, 3), i * 10, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    sound = clip(tmp_path / "a.mp4", 1)
    result = h3gen("compare", silent, sound, check_code=2)
    assert f"{silent} has no audio stream, and {sound} has one" in result.stderr
    cut = tmp_path / "cut.mp4"
    for kept in (2000, len(sound.read_bytes()) - 1):  # the last byte cut: every picture decodes, the file is not whole
        cut.write_bytes(sound.read_bytes()[:kept])
        result = h3gen("compare", cut, sound, check_code=2)
        assert result.stderr.startswith(f"h3gen: error: {cut}: truncated") and "Errno" not in \
            result.stderr, result.stderr


def test_when_no_pair_of_two_folders_can_be_compared_the_last_line_says_so(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for name in ("one.mp4", "two.mp4"):
        clip(a / name, 1), clip(b / name, 1, frames=39)
    result = h3gen("compare", a, b, "--json", check_code=2)
    assert result.stderr.count("not compared") == 2
    assert result.stderr.splitlines()[-1] == (
        f"h3gen: error: none of the 2 matched pairs of {a} and {b} could be compared (the notes above say why) "
        "(compare folders rendered from one prompts file at one size and duration)")
    assert [json.loads(line)["compared"] for line in result.stdout.splitlines()] == [False, False]


def test_when_the_one_matched_pair_of_two_folders_differs_json_still_says_what_was_left_out(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    clip(a / "one.mp4", 1), clip(b / "one.mp4", 1, frames=39), clip(b / "two.mp4", 2)
    result = h3gen("compare", a, b, "--json", check_code=2)
    assert result.stderr.splitlines()[-1].endswith("differ in frame counts (22 and 39) (compare clips rendered from "
                                                   "the same request (size, duration))"), result.stderr
    left_out = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["a"], r["b"], r["compared"]) for r in left_out] == [(None, str(b / "two.mp4"), False),
                                                                    (str(a / "one.mp4"), str(b / "one.mp4"), False)]


@pytest.mark.parametrize("order", ["folder first", "folder second"])
def test_a_missing_or_mismatched_argument_is_the_one_named(tmp_path, order):
    folder, missing = tmp_path / "out", tmp_path / "nonexist"
    clip(folder / "a.mp4", 1)
    args = (folder, missing) if order == "folder first" else (missing, folder)
    assert f"{missing} does not exist" in h3gen("compare", *args, check_code=2).stderr
    single = folder / "a.mp4"
    args = (folder, single) if order == "folder first" else (single, folder)
    result = h3gen("compare", *args, check_code=2)
    assert result.stderr.count("\n") == 1 and f"{folder} is a directory and {single} a file" in result.stderr


def test_full_size_frames_are_compared_a_frame_at_a_time_in_float32(monkeypatch):
    """SSIM's working set on the CPU grows with the pixels of a pass: at 1344x768 one frame in float32 (1.6 GB),
    never eight in float64 (40 GB); the values are the float64 ones to 1e-6."""
    import torch
    import torchmetrics.functional.image as image

    from h3gen.run import compare

    rng = np.random.default_rng(0)
    silent = np.zeros((0, 0), np.float32)

    def noisy_pair(shape):
        frames = rng.integers(0, 256, shape, dtype=np.uint8)
        noisy = np.clip(frames.astype(np.int16) + rng.integers(-9, 10, shape), 0, 255).astype(np.uint8)
        monkeypatch.setattr(compare, "read_clip", {Path("a"): (frames, silent, 0), Path("b"): (noisy, silent, 0)}.get)
        return frames, noisy

    passes, ssim = [], image.structural_similarity_index_measure

    def recorded(x, y, **kwargs):
        passes.append((tuple(x.shape), x.dtype))
        return ssim(x, y, **kwargs)

    monkeypatch.setattr(image, "structural_similarity_index_measure", recorded)
    noisy_pair((2, 768, 1344, 3))
    assert compare.compare(Path("a"), Path("b"))["frames"] == 2
    assert passes == [((1, 3, 768, 1344), torch.float32)] * 2
    frames, noisy = noisy_pair((5, 64, 96, 3))
    result = compare.compare(Path("a"), Path("b"))
    x, y = (torch.from_numpy(f).permute(0, 3, 1, 2).double() for f in (frames, noisy))
    exact = ssim(x, y, data_range=255.0, reduction="none")
    assert abs(result["ssim_mean"] - exact.mean().item()) < 1e-6
    assert abs(result["ssim_worst"] - exact.min().item()) < 1e-6
    assert 0 < result["ssim_mean"] < 1
