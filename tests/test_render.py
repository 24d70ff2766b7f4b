"""`h3gen render` end to end on the embedded tiny model, the way a user runs it."""

import json
import os
import re
import subprocess
import sys

from conftest import h3gen
from h3gen.run.validate import validate_clip

TWO_PROMPTS = 'a red fox in the snow\n# a comment\n\n{"id": "waves", "prompt": "waves on rocks", "seed": 5}\n'


def test_render_writes_valid_clips_and_json_lines(prompts_file, tmp_path):
    out = tmp_path / "out"
    result = h3gen("render", prompts_file(TWO_PROMPTS), "-o", out, "--json", check_code=0)
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["id"] for r in records] == [None, "waves"]
    assert [r["seed"] for r in records] == [0, 5]
    for record in records:
        assert record["ok"] and set(record["seconds"]) == {"encode", "sampler", "dit_forwards", "vae", "mux",
                                                           "vae_video", "vae_audio", "transfer"}
        assert record["rtf"] > 0 and record["frames"] == 124 and record["forwards"] == 3
        assert record["attention"] == "sdpa (PyTorch's choice)"
        assert validate_clip(record["path"], expected_frames=124) == []
    assert "smoke-test model" in result.stderr
    assert sorted(p.name for p in out.glob("*.mp4"))[-1] == "waves.mp4"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    (out / ".waves.mp4.partial.mp4").write_bytes(b"half a clip")  # as a run still writing one leaves it
    checked = h3gen("validate", out, check_code=0)  # a directory: each of its clips, not the hidden partial file
    assert checked.stdout.splitlines() == [f"{p}: ok" for p in sorted(out.glob("[!.]*.mp4"))] and checked.stderr == ""


def test_same_prompt_and_seed_give_byte_identical_mp4_under_a_stable_name(prompts_file, tmp_path):
    prompts = prompts_file("a lighthouse at night\n")
    for name in ("first", "second"):
        h3gen("render", prompts, "-o", tmp_path / name, check_code=0)
    (first,), (second,) = (list((tmp_path / name).glob("*.mp4")) for name in ("first", "second"))
    assert first.name == second.name and first.read_bytes() == second.read_bytes()
    # Another seed, another name (--dry-run prints the file each prompt would be written to).
    other = h3gen("render", prompts, "-o", tmp_path / "first", "--seed", 1, "--dry-run", check_code=0).stdout
    assert first.name not in other and ".mp4" in other


def test_a_dash_reads_the_prompts_from_standard_input(prompts_file, tmp_path):
    piped = h3gen("render", "-", "-o", tmp_path / "out", "--dry-run", input="a lighthouse at night\n",
                  check_code=0).stdout
    assert piped == h3gen("render", prompts_file("a lighthouse at night\n"), "-o", tmp_path / "out", "--dry-run",
                          check_code=0).stdout
    empty = h3gen("render", "-", "-o", tmp_path / "out", input="# nothing yet\n", check_code=2).stderr
    assert empty.startswith("h3gen: error: standard input has no prompts"), empty


def test_failed_clip_exits_1_and_the_others_are_written(prompts_file, tmp_path):
    prompts = prompts_file("short\n" + "a very long prompt " * 20 + "\n")
    result = h3gen("render", prompts, "-o", tmp_path / "out", "--json", "--set", "encode.max_tokens=12")
    assert result.returncode == 1
    # Clips report as they finish: the refused prompt fails at encoding, before the first clip renders.
    first, second = sorted((json.loads(line) for line in result.stdout.splitlines()), key=lambda r: r["line"])
    assert first["ok"] and not second["ok"]
    assert "over the encoder limit of 12" in second["error"]
    assert "1 failed" in result.stderr
    assert [p.name for p in (tmp_path / "out").glob("*.mp4")] == [first["path"].rsplit("/", 1)[1]]


def test_quiet_says_only_what_needs_someone(prompts_file, tmp_path):
    """--quiet, as cron runs it: the counts and after them the failed clip with its reason, said once; --json as
    ever; a rerun with nothing to do prints nothing at all on stderr."""
    prompts = prompts_file("short\n" + "a very long prompt " * 20 + "\n")
    result = h3gen("render", prompts, "-o", tmp_path / "out", "--json", "-q", "--set", "encode.max_tokens=12")
    assert result.returncode == 1 and len(result.stdout.splitlines()) == 2
    counts, reason = (line.split(" ", 2)[2] for line in result.stderr.splitlines())
    assert counts.startswith("1 of 2 clips written, 1 failed (")
    assert reason.startswith("  failed ") and "(line 2)" in reason and "over the encoder limit of 12" in reason
    again = h3gen("render", prompts_file("short\n"), "-o", tmp_path / "out", "--quiet", "--set",
                  "encode.max_tokens=12", check_code=0)
    assert again.stderr == "" and again.stdout == ""


LONG = "a red fox trots through fresh snow at dawn while crows call from the bare trees of the valley"
FORGED = LONG + "\nh3gen: error: forged \x1b[31mred"


def test_plain_lines_read_in_a_log(prompts_file, tmp_path):
    """stderr to a file: timestamped lines, a heartbeat in the sampler, full names and escaped prompts, a plain
    aligned summary with the wall time, and no third-party progress bar (the tiny model is written by this run)."""
    prompts = prompts_file(json.dumps({"prompt": FORGED}) + "\n")
    with open(tmp_path / "log", "w+") as log:
        run = subprocess.run([sys.executable, "-m", "h3gen.cli.main", "render", str(prompts), "-o", str(tmp_path / "out")],
                             stderr=log, stdout=subprocess.PIPE, env={**os.environ, "H3GEN_HEARTBEAT_S": "0",
                                                                      "XDG_CACHE_HOME": str(tmp_path / "cache")})
        log.seek(0)
        text = log.read()
    assert run.returncode == 0, text[-3000:]
    lines = text.splitlines()
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (.*)$")
    assert all(stamp.match(line) for line in lines), text
    said = [stamp.match(line).group(1) for line in lines]
    beats = [line.split(",")[0] for line in said if line.startswith("[1/1] sampler step")]
    assert beats == [f"[1/1] sampler step {i}/3" for i in (1, 2, 3)], text  # H3GEN_HEARTBEAT_S=0: every step
    assert any(re.fullmatch(r"\[1/1\] sampler step 1/3, \d+s, ETA \d+s", line) for line in said), text
    assert any(line.startswith("[1/1] sampler ") and line.endswith("s") for line in said)
    assert any("wrote" in line and "RTF" in line for line in said)
    name = next((tmp_path / "out").glob("*.mp4")).name
    assert any(line.startswith(f"{name}  ok") for line in said), text  # the summary: plain, with the full name
    assert LONG + "\\nh3gen: error: forged \\x1b[31mred" in text
    assert "\x1b" not in text and "\r" not in text and not any(line.startswith("h3gen: error") for line in said)
    assert re.search(r"1 of 1 clips written \(\d+s in all\)$", said[-1])
    assert not any(c in text for c in "┏┃│└")


def test_shown_escapes_what_a_terminal_would_act_on():
    from h3gen.text import shown

    assert shown("a\nb\r\x00\x1b[2J\u2028c é 日本") == "a\\nb\\r\\x00\\x1b[2J\\u2028c é 日本"


def test_validate_command_reports_bad_files(tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video")
    result = h3gen("validate", bad)
    assert result.returncode == 1 and "INVALID" in result.stderr


def test_validate_of_a_prompts_file_says_how_one_is_checked(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n")
    result = h3gen("validate", prompts, check_code=1)
    assert result.stderr == f"{prompts}: INVALID: not an MP4 (it does not start with an ftyp box); a prompts file is " \
                            f"checked with h3gen render {prompts} --dry-run\n"


def test_validate_of_a_directory_without_clips_says_so(tmp_path):
    folder = tmp_path / "clips"
    (folder / "day1").mkdir(parents=True)
    (folder / ".a.mp4.partial.mp4").write_bytes(b"half a clip")
    result = h3gen("validate", folder, check_code=2)
    assert result.stderr == f"{folder}: INVALID: is a directory with no .mp4 clips in it\n"


def test_a_one_process_run_on_a_machine_of_several_gpus_names_the_flag_that_uses_them():
    """Said after the load line of a one-process CUDA run (run.loop.render_pending); workers and one clip say nothing."""
    from h3gen.run.loop import idle_gpus_note

    assert idle_gpus_note(10, 8) == ("this run renders on one GPU and the other 7 of this machine stay idle; --gpus 8 "
                                     "renders a clip on each")
    assert idle_gpus_note(3, 8).endswith("; --gpus 3 renders the 3 clips at once")
    assert idle_gpus_note(1, 8) == idle_gpus_note(10, 1) == ""
