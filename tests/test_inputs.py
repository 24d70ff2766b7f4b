"""Bad input is refused before anything loads: one line naming the problem and the fix, exit 2, no output file."""

import re

import pytest

from conftest import h3gen
from h3gen.errors import UsageError
from h3gen.inputs.prompts import read_prompts

DEFAULTS = {"width": 32, "height": 32, "duration": 5.0}


def parse(tmp_path, text):
    path = tmp_path / "p.txt"
    path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
    return read_prompts(path, base_seed=10, defaults=DEFAULTS)


def test_plain_and_json_lines(tmp_path):
    requests = parse(tmp_path, 'first\n\n# skipped\n{"prompt": "second", "duration": 10, "width": 64, "height": 32}\n')
    assert [(r.prompt, r.seed, r.frames, r.width, r.line) for r in requests] == [
        ("first", 10, 124, 32, 1), ("second", 11, 243, 64, 4)]


@pytest.mark.parametrize("text, message", [
    ("", "has no prompts"),
    ("# only a comment\n", "has no prompts"),
    ('ok\n{"prompt": "x",\n "seed": 1}\n', "p.txt:2: malformed JSON at column 16: the line ends before its object "
                                          "does (an object must be whole on its line)"),
    ('{"prompt": "x"\n', "p.txt:1: malformed JSON at column 15: the line ends before its object does"),
    ('{"prompt": "x", "colour": "red"}\n', "unknown field 'colour'"),
    ('{"prompt": "x", "seed": 3,}\n', "p.txt:1: malformed JSON at column 27: a comma before the closing bracket, "
                                     "which JSON does not allow"),
    ('{"prompt": "x", "seed": 1, "prompt": "y"}\n', "p.txt:1: field 'prompt' is given twice"),
    ('{"prompt": "x", "seed": "7"}\n', "field 'seed' has the wrong type"),
    ('{"id": "a"}\n', "missing or empty 'prompt'"),
    ('{"prompt": "x", "duration": 4}\n', "duration 4 s is outside"),
    ('{"prompt": "x", "duration": 16}\n', "duration 16 s is outside"),
    ('{"prompt": "x", "width": 100}\n', "not made of multiples of 32"),
    ('{"prompt": "x", "width": 640, "height": 32}\n', "size 640x32 is outside H3's aspect ratios of 1:4 to 4:1 (use "
                                                     "128x32, the nearest size H3 takes"),
    ('{"prompt": "x", "width": 1000}\n', "size 1000x32 (its height the preset's) is not made of multiples of 32 "
                                         "(use 128x32, the nearest size H3 takes: sides in multiples of 32, within "
                                         "1:4 to 4:1; or give the line a height too)"),
    ('{"prompt": "x", "width": 0, "height": 64}\n', "size 0x64 has a side under 32 pixels (use 32x64"),
    ('{"prompt": "x", "id": "a"}\n{"prompt": "y", "id": "a"}\n', "duplicate id 'a'"),
    ('{"prompt": "x", "id": "../escape"}\n', "is not a plain file name"),
    ('{"prompt": "x", "id": "/etc/passwd"}\n', "is not a plain file name"),
    (b"caf\xe9\n", "p.txt:1:4: not UTF-8 text (the byte 0xE9) (save the prompts file as UTF-8)"),
])
def test_bad_prompts_files(tmp_path, text, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        parse(tmp_path, text)


def test_one_run_names_every_bad_line_each_on_a_line_of_its_own(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b'ok\n{"prompt": "x", "colour": 1}\nfine\n{"prompt": "y", "duration": 20}\n{"prompt": "z",\n'
                        b'{"id": "a", "prompt": "b"}\n{"id": "a", "prompt": "c"}\n  caf\xe9\n')
    result = h3gen("render", prompts, "-o", tmp_path / "out", check_code=2)
    assert [line.split(" (")[0] for line in result.stderr.splitlines()] == [
        f"h3gen: error: {prompts}:2: unknown field 'colour'",
        f"h3gen: error: {prompts}:4: duration 20 s is outside H3's 5-15 s",
        f"h3gen: error: {prompts}:5: malformed JSON at column 16: the line ends before its object does",
        f"h3gen: error: {prompts}:7: duplicate id 'a'",
        f"h3gen: error: {prompts}:8:6: not UTF-8 text"], result.stderr
    assert not (tmp_path / "out").exists()


def test_two_lines_writing_one_file_are_named_with_the_other_bad_lines_in_their_order(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x", "id": "a"}\n{"prompt": "y", "id": "a.mp4"}\n{"prompt": "z", "id": 5}\n')
    result = h3gen("render", prompts, "-o", tmp_path / "out", "--dry-run", check_code=2)
    assert [line.split(" (")[0] for line in result.stderr.splitlines()] == [
        f"h3gen: error: {prompts}:2: writes a.mp4, as line 1 does",
        f"h3gen: error: {prompts}:3: field 'id' has the wrong type"], result.stderr


def test_past_twenty_bad_lines_the_rest_are_counted_and_a_bad_line_keeps_its_place_in_the_seeds(tmp_path):
    with pytest.raises(UsageError) as refused:
        parse(tmp_path, "".join(f'{{"prompt": "p{n}", "duration": 99}}\n' for n in range(25)))
    shown = [refused.value, *refused.value.also]
    assert [e.problem.split(": ")[0] for e in shown[:20]] == [f"{tmp_path / 'p.txt'}:{n}" for n in range(1, 21)]
    assert str(shown[20]) == f"{tmp_path / 'p.txt'}: 5 more bad lines after these (fix these and run again to see them)"
    assert len(shown) == 21
    path = tmp_path / "seeds.txt"
    path.write_text('x\n{"prompt": "y", "duration": 99}\nz\n')  # z is the third clip, whatever is wrong with y
    with pytest.raises(UsageError) as carried:
        read_prompts(path, base_seed=2**63 - 2, defaults=DEFAULTS)
    assert [e.problem.split(": ")[0] for e in (carried.value, *carried.value.also)] == [f"{path}:2", f"{path}:3"]
    assert "plus the clip's index 2" in carried.value.also[0].problem


def test_every_problem_of_a_line_is_named_and_twenty_lines_are_shown_whatever_each_holds(tmp_path):
    lines = ['{"prompt": "z", "duration": 100, "id": "bad id!", "seed": -1}',
             '{"prompt": 5, "colour": "red", "width": "wide"}',
             '{"prompt": "y", "width": 33, "height": 768, "duration": 2}',
             '{"prompt": "x", "first_frame": "missing.png", "duration": 99}']
    with pytest.raises(UsageError) as refused:
        parse(tmp_path, "\n".join(lines) + "\n")
    shown = [(e.problem.split(": ")[0].rsplit(":", 1)[1], e.problem.split(": ", 1)[1].split(" (")[0])
             for e in (refused.value, *refused.value.also)]
    assert [(line, problem.split(" is ")[0].split(" has ")[0].split(" /")[0]) for line, problem in shown] == [
        ("1", "duration 100 s"), ("1", "id 'bad id!'"), ("1", "seed -1"),
        ("2", "field 'prompt'"), ("2", "unknown field 'colour'"), ("2", "field 'width'"),
        ("3", "duration 2 s"), ("3", "size 33x768"),
        ("4", "duration 99 s"), ("4", "first_frame")], shown
    with pytest.raises(UsageError) as refused:  # the cut counts lines, each shown with all of its problems
        parse(tmp_path, "".join(f'{{"prompt": "p{n}", "duration": 99, "seed": -1}}\n' for n in range(25)))
    shown = [refused.value, *refused.value.also]
    assert len(shown) == 41 and str(shown[-1]).startswith(f"{tmp_path / 'p.txt'}: 5 more bad lines after these")


def test_wrong_type_names_the_type_it_takes(tmp_path):
    with pytest.raises(UsageError) as refused:
        parse(tmp_path, '{"prompt": "x", "duration": "10"}\n')
    assert "field 'duration' has the wrong type (\"10\")" in str(refused.value)
    assert "give a number, unquoted" in refused.value.fix


def test_a_base_seed_out_of_range_is_blamed_on_the_base_seed_not_a_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('x\n{"prompt": "y", "seed": 3}\nz\n')
    with pytest.raises(UsageError, match=r"^base seed -1 is out of range") as refused:
        read_prompts(path, base_seed=-1, defaults=DEFAULTS)
    assert "--seed" in refused.value.fix
    # A valid base seed that the clip's index carries past the range: the line, and where its seed came from.
    carried = r"p.txt:3: seed 9223372036854775808 \(the base seed 9223372036854775806 plus the clip's index 2\)"
    with pytest.raises(UsageError, match=carried):
        read_prompts(path, base_seed=2**63 - 2, defaults=DEFAULTS)


def test_missing_prompts_file_exits_2_with_one_line(tmp_path):
    result = h3gen("render", tmp_path / "nope.txt", "-o", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "does not exist" in result.stderr
    assert not (tmp_path / "out").exists()


def test_impossible_duration_exits_2_before_loading(prompts_file, tmp_path):
    result = h3gen("render", prompts_file('{"prompt": "x", "duration": 30}\n'), "-o", tmp_path / "out")
    assert result.returncode == 2 and "ask for 5 to 15 seconds" in result.stderr


def test_unwritable_output_directory(prompts_file, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = h3gen("render", prompts_file("x\n"), "-o", blocker / "out")
    assert result.returncode == 2 and "out cannot be created (Not a directory)" in result.stderr


# -- line endings, a byte-order mark, what a line may hold ----------------------------------------------------------

def test_a_byte_order_mark_is_dropped(tmp_path):
    """Editors on Windows start the file with U+FEFF: the first line reads as it would without it."""
    for first in ('{"id": "fox", "prompt": "a fox"}', "a fox"):
        text = f"{first}\nwaves\n"
        with_bom = parse(tmp_path, "\ufeff" + text)
        assert with_bom == parse(tmp_path, text)
    assert parse(tmp_path, '\ufeff{"id": "fox", "prompt": "a fox"}\n')[0].id == "fox"
    assert parse(tmp_path, "\ufeffa fox\n")[0].prompt == "a fox"


def test_lines_end_at_newline_only(tmp_path):
    """U+2028 and the other breaks str.splitlines honours are part of a line; \\r\\n is accepted."""
    import json

    inside = "a fox\u2028in snow\x1c\x85\u2029at dawn"
    text = json.dumps({"id": "fox", "prompt": inside}, ensure_ascii=False) + "\n" + inside + "\nlast\n"
    requests = parse(tmp_path, text)
    assert [(r.id, r.prompt, r.line) for r in requests] == [("fox", inside, 1), (None, inside, 2), (None, "last", 3)]
    assert parse(tmp_path, "one\r\n{\"prompt\": \"two\"}\r\n") == parse(tmp_path, "one\n{\"prompt\": \"two\"}\n")
    with pytest.raises(UsageError, match="p.txt:3: malformed JSON"):
        parse(tmp_path, "one\u2028two\nthree\n{\"prompt\": \n")


@pytest.mark.parametrize("line", ['["a", "b"]', "[cinematic] a fox", "[]", "{not json}"])
def test_a_line_starting_with_a_bracket_is_json_or_an_error(tmp_path, line):
    with pytest.raises(UsageError, match="p.txt:2: "):
        parse(tmp_path, f"first\n{line}\n")


# -- messages that say what is wrong --------------------------------------------------------------------------------

def refused_with(result, message):
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("h3gen: error: ") and result.stderr.strip().count("\n") == 0, result.stderr
    assert message in result.stderr, result.stderr


def test_a_preset_that_is_a_directory_is_named_so(prompts_file, tmp_path):
    refused_with(h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--preset", tmp_path),
                 f"preset {tmp_path} is a directory")


def test_an_output_that_is_a_file_is_named_so(prompts_file, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = h3gen("render", prompts_file("x\n"), "-o", blocker)
    refused_with(result, f"output directory {blocker} is not a directory")
    assert "File exists" not in result.stderr


@pytest.mark.parametrize("below", ["", "sub"])
def test_an_output_under_a_link_to_a_missing_folder_names_the_link(prompts_file, tmp_path, below):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "missing")
    result = h3gen("render", prompts_file("x\n"), "-o", link / below if below else link)
    refused_with(result, f"{link} is a link to {tmp_path / 'missing'}, which is not there (create the folder the link "
                         "points to, or pass -o with another directory)")
    assert "File exists" not in result.stderr and not (tmp_path / "missing").exists()


def test_cuda_without_a_gpu_says_so_before_loading(prompts_file, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--set", "runtime.device=cuda")
    refused_with(result, "runtime.device is cuda but no CUDA device is visible")
    assert "loaded on" not in result.stderr and "model folder" not in result.stderr


@pytest.mark.parametrize("frames", ["-3", "0"])
def test_validate_refuses_a_frame_count_below_one(tmp_path, frames):
    result = h3gen("validate", tmp_path / "x.mp4", "--frames", frames)
    assert result.returncode == 2 and "--frames" in result.stderr


def test_the_disk_check_shows_sizes_that_differ(tmp_path, monkeypatch):
    import shutil

    from h3gen.errors import ClipError
    from h3gen.inputs.request import Request
    from h3gen.run.outputs import check_disk, sizes_that_differ

    tiny_clip = Request(index=0, prompt="x", seed=0, width=32, height=32, frames=124)  # needs 1.06 MiB at 8.75
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 2**20, 2**20))
    with pytest.raises(ClipError, match=r"only 1\.0 MiB free in .*, the clip needs about 1\.1 MiB"):
        check_disk(tmp_path, tiny_clip, bytes_per_pixel=8.75)
    assert sizes_that_differ(300 * 2**10, 600 * 2**10) == ("300 KiB", "600 KiB")
    assert sizes_that_differ(512, 100 * 2**10) == ("0 KiB", "100 KiB")
    assert sizes_that_differ(3 * 2**30, 2**20) == ("3 GiB", "0 GiB")


def test_an_output_directory_where_no_file_can_be_made_says_so(prompts_file):
    """/proc is there and a directory, yet creating a file in it fails as if a path were missing."""
    result = h3gen("render", prompts_file("x\n"), "-o", "/proc", "--dry-run", check_code=2)
    assert result.stderr.strip() == ("h3gen: error: output directory /proc is not writable (no file can be created in "
                                     "it) (pass -o with a directory you can write to)")
