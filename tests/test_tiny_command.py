"""`h3gen tiny` and the default model's cache: written whole, at an absolute path, repaired when damaged, and
never over a folder that holds anything else."""

import shutil

import pytest

from conftest import h3gen
from h3gen.run import fingerprint


def test_a_relative_folder_gets_the_model_at_its_absolute_path(tmp_path, tiny_model):
    result = h3gen("tiny", "models/tiny", cwd=tmp_path, check_code=0)
    written = tmp_path / "models" / "tiny"
    assert result.stdout.strip() == str(written)
    index = (written / "modular_model_index.json").read_text()
    assert f'"{written}' in index and '"models/tiny' not in index
    fingerprint.model_identity.cache_clear()
    assert fingerprint.model_identity(str(written)) == fingerprint.model_identity(str(tiny_model))


def flip_a_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]


@pytest.mark.parametrize("component, damage", [
    ("vae", lambda data: data[:100]),  # the header cut
    ("transformer_ref", lambda data: data[:1000]),  # the header whole, the tensors cut
    ("transformer", flip_a_byte),
    ("audio_vae", None),  # gone
])
def test_a_damaged_tiny_model_is_written_anew(tmp_path, tiny_model, component, damage):
    """The same bytes as before it was damaged (the tiny model is written deterministically)."""
    copy = tmp_path / "tiny"
    shutil.copytree(tiny_model, copy)
    weights = copy / component / "diffusion_pytorch_model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(damage(whole)) if damage else weights.unlink()
    result = h3gen("tiny", copy, check_code=0)
    assert weights.read_bytes() == whole
    assert f"h3gen: note: the tiny model in {copy} is damaged: written again\n" in result.stderr
    assert "damaged" not in h3gen("tiny", copy, check_code=0).stderr  # whole now: nothing to say


def test_a_tiny_model_with_its_readme_and_a_config_damaged_is_written_anew(tmp_path, tiny_model):
    """Its file list still says h3gen wrote it: a README overwritten does not make it someone else's folder."""
    copy = tmp_path / "tiny"
    shutil.copytree(tiny_model, copy)
    config = copy / "transformer" / "config.json"
    whole = config.read_bytes(), (copy / "README.md").read_bytes()
    config.write_text("{}")
    (copy / "README.md").write_text("corrupt")
    h3gen("tiny", copy, check_code=0)
    assert (config.read_bytes(), (copy / "README.md").read_bytes()) == whole


def test_a_folder_holding_another_model_is_not_taken_for_the_tiny_one(tmp_path, tiny_model):
    """A repository h3gen did not write as its tiny model (no file list, no tiny README): refused, left as it is."""
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    (other / ".h3gen-tiny-files.json").unlink()
    (other / "README.md").write_text("MiniMax-H3")
    result = h3gen("tiny", other, check_code=2)
    assert "holds other files, and the tiny model is written only into a new or empty folder" in result.stderr
    assert (other / "README.md").read_text() == "MiniMax-H3"


@pytest.mark.parametrize("place, message, fix", [
    ("file", "is a file", "pass a folder for the tiny model that is new or empty"),
    ("clips", "holds other files, and the tiny model is written only into a new or empty folder",
     "pass a folder for the tiny model that is new or empty"),
    ("/proc/h3gen-nope/tiny", "cannot write the tiny model into /proc/h3gen-nope/tiny (", "pass a folder you can "
                                                                                          "write to"),
])
def test_a_folder_it_cannot_or_must_not_write_is_refused_with_exit_2(tmp_path, place, message, fix):
    (tmp_path / "file").write_text("mine")
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.mp4").write_bytes(b"mine")
    target = tmp_path / place
    result = h3gen("tiny", target, check_code=2)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("h3gen: error: ") and message in last and last.endswith(f"({fix})"), last
    assert (tmp_path / "file").read_text() == "mine" and (tmp_path / "clips" / "a.mp4").read_bytes() == b"mine"


def test_a_cache_folder_it_cannot_write_is_said_as_such(prompts_file, tmp_path):
    """The default model cannot be written into XDG_CACHE_HOME: exit 2 and the variable to change, not a disk to
    free."""
    result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out",
                   env={"XDG_CACHE_HOME": "/proc/h3gen-nope"}, check_code=2)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("h3gen: error: cannot write the tiny model into /proc/h3gen-nope/h3gen/tiny-v"), last
    assert last.endswith("(set XDG_CACHE_HOME to a folder you can write to, or pass --model)")
    assert not (tmp_path / "out").exists()


def test_a_file_size_limit_is_said_as_one_not_as_a_full_disk(tmp_path):
    import errno

    from h3gen.models.tiny import write_failure

    error = write_failure(tmp_path / "m", OSError(errno.EFBIG, "File too large"), default=False)
    assert str(error) == (f"cannot write the tiny model into {tmp_path / 'm'} (File too large) (a file size limit "
                          "stops it: raise `ulimit -f`)")
    assert "free space in" in str(write_failure(tmp_path / "m", OSError(errno.ENOSPC, "No space"), default=False))
