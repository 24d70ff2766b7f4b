"""Model directories: layout, safetensors only, corrupt files named, never unpickled."""

import re
import shutil

import pytest

from conftest import h3gen
from h3gen.errors import ModelError
from h3gen.models.repo import ModelRepo


@pytest.fixture
def repo_copy(tiny_model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    return copy


def test_tiny_model_has_the_repository_layout(tiny_model):
    repo = ModelRepo(tiny_model)
    for name in ("transformer", "vae", "audio_vae", "text_encoder", "tokenizer", "processor", "scheduler"):
        assert repo.path(name).is_dir()
    assert (tiny_model / "modular_model_index.json").is_file()


def test_tiny_model_is_written_deterministically(tmp_path):
    from h3gen.models.tiny import write_tiny_model

    write_tiny_model(tmp_path / "a")
    write_tiny_model(tmp_path / "b")
    for weights in (tmp_path / "a").rglob("*.safetensors"):
        assert weights.read_bytes() == (tmp_path / "b" / weights.relative_to(tmp_path / "a")).read_bytes()


def test_missing_component(repo_copy):
    shutil.rmtree(repo_copy / "vae")
    with pytest.raises(ModelError, match="vae is missing"):
        ModelRepo(repo_copy)


def test_pickle_only_checkpoint_is_refused(repo_copy):
    weights = repo_copy / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_suffix(".bin"))
    with pytest.raises(ModelError, match="is a pickle checkpoint; h3gen loads safetensors only"):
        ModelRepo(repo_copy)


def test_truncated_safetensors_names_the_file(repo_copy):
    weights = repo_copy / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelError, match="corrupt or truncated checkpoint .*vae/diffusion_pytorch_model"):
        ModelRepo(repo_copy)


def test_safetensors_with_bytes_after_its_tensors_names_the_file_and_why(repo_copy):
    weights = repo_copy / "transformer" / "diffusion_pytorch_model.safetensors"
    with weights.open("ab") as f:
        f.write(b"garbage\n")  # `echo garbage >> file`: the loader itself would refuse it without saying why
    with pytest.raises(ModelError) as error:
        ModelRepo(repo_copy)
    assert str(error.value) == (f"corrupt or truncated checkpoint {weights} (8 stray bytes after its tensors) "
                                "(re-download this file from the repository)")


@pytest.mark.parametrize("content, why", [
    (b"\x10" * 64, "truncated, or not safetensors: its header would be longer than the file"),  # never read
    ((2).to_bytes(8, "little") + b"[]", "its header is not a safetensors header")], ids=["garbage", "list"])
def test_garbage_safetensors_names_the_file_and_why(repo_copy, content, why):
    weights = repo_copy / "audio_vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(content)
    with pytest.raises(ModelError) as error:
        ModelRepo(repo_copy)
    assert str(error.value) == (f"corrupt or truncated checkpoint {weights} ({why}) (re-download this file from the "
                                "repository)")


@pytest.mark.parametrize("folder", ["transformer", "vae", "text_encoder"])
@pytest.mark.parametrize("text, why", [('{"hidden_size": 64', "is not valid JSON (Expecting"),
                                       ("[1, 2]", "holds a JSON list, not an object")])
def test_a_malformed_config_names_the_file_and_exits_2(repo_copy, prompts_file, tmp_path, folder, text, why):
    config = repo_copy / folder / "config.json"
    config.write_text(text)
    out = tmp_path / "out"
    result = h3gen("render", prompts_file("x\n"), "-o", out, "--model", repo_copy, "--preset", "tiny")
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"h3gen: error: {config} {why}") and "a bug" not in last, last
    assert last.endswith("(re-download this file from the repository)") and not out.exists()


@pytest.mark.parametrize("text, why", [("{bad", "is not valid JSON (Expecting"),
                                       ("[1]", "holds a JSON list, not an object")])
def test_a_malformed_model_index_is_refused_before_any_weight_loads(repo_copy, prompts_file, tmp_path, text, why):
    """The canvas rules of keyframes and references come from it: a damaged one would silently give others."""
    index = repo_copy / "modular_model_index.json"
    index.write_text(text)
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--model", repo_copy, "--preset", "tiny",
                   "--dry-run", check_code=2)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"h3gen: error: {index} {why}") and last.endswith("(re-download this file from the "
                                                                            "repository)"), last


def test_shapes_that_do_not_match_the_config_exit_2(repo_copy, prompts_file, tmp_path):
    config = repo_copy / "transformer" / "config.json"
    config.write_text(config.read_text().replace('"hidden_size": 64', '"hidden_size": 96'))
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--model", repo_copy, "--preset", "tiny")
    assert result.returncode == 2
    assert "cannot load transformer" in result.stderr and result.stderr.strip().count("\n") <= 2
    assert "ignore_mismatched_sizes" not in result.stderr  # advice to load mismatched weights anyway
    assert not list((tmp_path / "out").glob("*.mp4"))


def test_not_a_directory_exits_2(prompts_file, tmp_path):
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--model", tmp_path / "none")
    assert result.returncode == 2 and "does not exist" in result.stderr
    a_file = prompts_file("x\n")
    result = h3gen("render", a_file, "-o", tmp_path / "out", "--model", a_file)
    assert result.returncode == 2 and f"model directory {a_file} is a file (pass --model DIR" in result.stderr


def test_a_config_that_does_not_match_its_weights_names_the_file(repo_copy, prompts_file, tmp_path):
    """One layer more in the config than in the weights: the error names the config and its folder's weights."""
    import json

    config = repo_copy / "transformer" / "config.json"
    fields = json.loads(config.read_text())
    fields["num_layers"] += 1
    config.write_text(json.dumps(fields))
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--model", repo_copy,
                   "--preset", "tiny")
    assert result.returncode == 2, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("h3gen: error: ") and str(config) in error, error
    assert "meta tensor" not in error


def test_a_tokenizer_without_its_vocabulary_is_refused_before_loading(repo_copy, prompts_file, tmp_path):
    (repo_copy / "tokenizer" / "tokenizer.json").unlink()
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--model", repo_copy, "--preset", "tiny",
                   "--dry-run", check_code=2)
    assert result.stderr == (f"h3gen: error: {repo_copy / 'tokenizer'} has no tokenizer.json (nor vocab.json and "
                             "merges.txt) (copy the complete folder from the repository)\n")


def test_a_corrupt_tokenizer_file_is_named(repo_copy, prompts_file, tmp_path):
    broken = repo_copy / "tokenizer" / "tokenizer.json"
    broken.write_text('{"version": \n')
    out = tmp_path / "out"
    result = h3gen("render", prompts_file("x\n"), "-o", out, "--model", repo_copy, "--preset", "tiny", check_code=2)
    assert result.stderr.splitlines()[-1].startswith(f"h3gen: error: {broken} is not valid JSON ("), result.stderr
    assert result.stderr.splitlines()[-1].endswith("(re-download this file from the repository)")
    assert not out.exists()  # the run made the folder and wrote nothing: it goes again


@pytest.mark.parametrize("dit", ["diffusers", "h3gen"])
def test_a_config_value_of_the_wrong_type_is_the_file_s_fault_not_a_bug(repo_copy, prompts_file, tmp_path, dit):
    config = repo_copy / "transformer" / "config.json"
    config.write_text(re.sub(r'"attention_head_dim": \d+', '"attention_head_dim": "abc"', config.read_text()))
    result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", "--model", repo_copy, "--preset", "tiny",
                   "--set", f"sampler.dit={dit}", check_code=2)
    assert 'attention_head_dim is "abc", where a whole number belongs' in result.stderr.splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_the_text_encoder_s_layers_are_read_from_its_config_as_transformers_reads_them(repo_copy):
    import json

    repo = ModelRepo(repo_copy)
    assert repo.text_encoder_layers() == repo.text_encoder_config().text_config.num_hidden_layers == 51
    config = repo_copy / "text_encoder" / "config.json"
    values = json.loads(config.read_text())
    del values["text_config"]["num_hidden_layers"]  # left to transformers' default
    config.write_text(json.dumps(values))
    assert repo.text_encoder_layers() == repo.text_encoder_config().text_config.num_hidden_layers != 51


def test_mistyped_takes_whole_numbers_for_floats_and_null_for_the_class_s_choice():
    from h3gen.models.repo import mistyped

    defaults = {"eps": 1e-5, "layers": 2, "flag": False, "act": "silu", "size": None}
    assert mistyped({"eps": 1, "layers": 3, "flag": True, "act": "gelu", "size": [1, 2], "other": "x"}, defaults) == ""
    assert mistyped({"layers": None}, defaults) == ""
    assert mistyped({"layers": True}, defaults) == "layers is true, where a whole number belongs"
    assert mistyped({"layers": 2.5}, defaults) == "layers is 2.5, where a whole number belongs"
    assert mistyped({"eps": "1e-5"}, defaults) == 'eps is "1e-5", where a number belongs'
    assert mistyped({"flag": 1}, defaults) == "flag is 1, where true or false belongs"
