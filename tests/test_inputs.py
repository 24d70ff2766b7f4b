"""Bad input is refused before anything loads: one line naming the problem and the fix, exit 2, no output file."""

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
    ('ok\n{"prompt": "x",\n', "p.txt:2: malformed JSON"),
    ('{"prompt": "x", "colour": "red"}\n', "unknown field 'colour'"),
    ('{"prompt": "x", "seed": "7"}\n', "field 'seed' has the wrong type"),
    ('{"id": "a"}\n', "missing or empty 'prompt'"),
    ('{"prompt": "x", "duration": 4}\n', "duration 4 s is outside"),
    ('{"prompt": "x", "duration": 16}\n', "duration 16 s is outside"),
    ('{"prompt": "x", "width": 100}\n', "not made of multiples of 32"),
    ('{"prompt": "x", "width": 640, "height": 32}\n', "aspect ratio 640x32"),
    ('{"prompt": "x", "id": "a"}\n{"prompt": "y", "id": "a"}\n', "duplicate id 'a'"),
    ('{"prompt": "x", "id": "../escape"}\n', "is not a plain file name"),
    ('{"prompt": "x", "id": "/etc/passwd"}\n', "is not a plain file name"),
    (b"caf\xe9\n", "p.txt:1: not UTF-8"),
])
def test_bad_prompts_files(tmp_path, text, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        parse(tmp_path, text)


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
    assert result.returncode == 2 and "is not writable" in result.stderr
