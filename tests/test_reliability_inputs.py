"""Bad input from the command line: every refusal is one line naming the problem and the fix, exit 2, and nothing
written, nothing imported, nothing unpickled, no remote code run.

test_inputs.py, test_presets.py and test_model_repo.py check the parsers' messages; these check what the command
does with them.
"""

import json
import pickle
import shutil

import pytest
from typer.testing import CliRunner

from conftest import ROOT, h3gen, left_out_note

TINY_PRESET = (ROOT / "presets" / "tiny.toml").read_text()


def refused(result, message):
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("h3gen: error: ") and result.stderr.strip().count("\n") == 0, result.stderr
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize("text, message", [
    ("", "has no prompts"),
    ('ok\n{"prompt": "x",\n', "prompts.txt:2: malformed JSON"),
    ('{"prompt": "x", "colour": "red"}\n', "prompts.txt:1: unknown field 'colour'"),
    ('{"prompt": "x", "duration": 4.5}\n', "duration 4.5 s is outside H3's 5-15 s"),
    ('{"prompt": "x", "duration": 15.5}\n', "duration 15.5 s is outside H3's 5-15 s"),
    ('{"prompt": "x", "width": 1000, "height": 768}\n', "size 1000x768 is not made of multiples of 32 (use 992x768, "
                                                      "the nearest size H3 takes"),
    ('{"prompt": "x", "width": 32, "height": 4096}\n', "size 32x4096 is outside H3's aspect ratios of 1:4 to 4:1 "
                                                      "(use 32x128"),
    ('{"prompt": "x", "id": "a"}\n{"prompt": "y", "id": "a"}\n', "prompts.txt:2: duplicate id 'a' (first on line 1)"),
    ('{"prompt": "x", "id": "Fox"}\n{"prompt": "y", "id": "fox"}\n', "prompts.txt:2: writes fox.mp4, as line 1 does as "
                                                              "Fox.mp4, one file on macOS and Windows (give the clips ids that differ in more "
                                                              "than case)"),
    ('{"prompt": "x", "id": "../../etc/cron.d/x"}\n', "id '../../etc/cron.d/x' is not a plain file name"),
    ('{"prompt": "x", "id": "/tmp/x"}\n', "id '/tmp/x' is not a plain file name"),
    ('{"prompt": "x", "id": ".hidden"}\n', "id '.hidden' is not a plain file name"),
    ('{"prompt": "x", "id": "a\\nb"}\n', "id 'a\\nb' is not a plain file name"),
    ('{"prompt": "x", "id": "-x"}\n', "id '-x' is not a plain file name (start it with an ASCII letter or digit, then "),
    ('{"prompt": "x", "id": "%s"}\n' % ("a" * 129), "characters at most"),
    ('{"prompt": "same", "seed": 3}\n{"prompt": "same", "seed": 3}\n', "prompts.txt:2: writes h3-"),
    ('{"prompt": "same", "seed": 3}\n{"prompt": "same", "seed": 3}\n', "as line 1 does (give one of them another seed "
                                                                   "or an id)"),
    ('{"prompt": "x", "id": "Fox.mp4"}\n{"prompt": "y", "id": "fox"}\n', "prompts.txt:2: writes fox.mp4, as line 1 "
                                                                   "does as Fox.mp4, one file on macOS and Windows"),
    ('{"prompt": "a", "id": "v.mp4"}\n{"prompt": "b", "id": "v"}\n', "prompts.txt:2: writes v.mp4, as line 1 does (give "
                                                                 "the clips ids that name different files)"),
    (b"ok\n\xff\xfe\n", "prompts.txt:2:1: not UTF-8 text (the byte 0xFF)"),
    (b"\xe9t\xe9 \xe0 Paris\n" * 100, "prompts.txt:1: not UTF-8 text (more than 256 bytes that UTF-8 cannot read)"),
    ("ok\nA red fox\n".encode("utf-16-le"), "prompts.txt:1: a NUL byte, so not UTF-8 text (UTF-16, or not text"),
    (b"a fox\n" + bytes(300), "prompts.txt:2: a NUL byte, so not UTF-8 text"),
    ('["a", "b"]\n', "prompts.txt:1: a JSON line must be an object"),
    # nesting past Python's recursion limit, and past what a request holds but within it
    ('{"prompt": "x", "references": %s%s}\n' % ("[" * 1200, "]" * 1200), "prompts.txt:1: JSON nested deeper than the 8 "
                                                                       "levels a request can have"),
    ('{"prompt": "x", "references": %s%s}\n' % ("[" * 900, "]" * 900), "prompts.txt:1: JSON nested deeper than the 8 "),
    ('{"prompt": "\\ud800"}\n', "prompts.txt:1: field 'prompt' holds a lone UTF-16 surrogate"),
    ('{"id": "sur", "prompt": "x\\udfff y"}\n', "prompts.txt:1: field 'prompt' holds a lone UTF-16 surrogate"),
    ('{"prompt": "x", "width": 320000, "height": 320000}\n', "prompts.txt:1: size 320000x320000 at 124 frames needs"),
    ('{"prompt": "x", "width": 16384, "height": 16384, "duration": 15}\n', "prompts.txt:1: size 16384x16384 at 345 frames"),
])
def test_bad_prompts_file_is_refused_before_anything_loads(tmp_path, text, message):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "out"
    refused(h3gen("render", prompts, "-o", out, "--model", tmp_path / "no-model-needed"), message)
    assert not out.exists()


@pytest.mark.parametrize("values, message", [
    (["sampler.steps=0"], "the sigma grid needs at least 2 points"),
    (["sampler.video_shift=0"], "sampler.video_shift is 0.0, and a sigma shift must be above 0 and finite"),
    (["sampler.audio_shift=-3"], "sampler.audio_shift is -3.0, and a sigma shift must be above 0 and finite"),
    (["sampler.video_shift=inf"], "sampler.video_shift is inf, and a sigma shift must be above 0 and finite"),
    (["sampler.audio_shift=1e-10"], "sampler.audio_shift = 1e-10 gives sigmas that are not finite, so the sampler "
                                    "would run fewer forwards than its "),
    (["sampler.video_shift=1e8"], "sampler.video_shift = 100000000.0 gives "),
    (["sampler.steps=1000000000"], "the sigma grid has 1000000000 points, more than h3gen runs (1000)"),
    (["sampler.sigma_positions=[0.5, 0.9, 0]"], "sampler.sigma_positions [0.5, 0.9, 0.0] is not a decreasing grid"),
    (["sampler.sigma_positions=[1.5, 0.5, 0]"], "sampler.sigma_positions [1.5, 0.5, 0.0] is not a decreasing grid"),
    (["sampler.sigma_positions=[0.9, 0.5, 0.1]"], "sampler.sigma_positions [0.9, 0.5, 0.1] does not end at 0, where "
                                                  "the clip is clean (list the positions from the highest to 0"),
    (["sampler.sigma_positions=[0.5]"], "--set sampler.sigma_positions: sampler.sigma_positions [0.5] is one point"),
    (["encode.max_tokens=0"], "encode.max_tokens is 0, so every prompt would be over it"),
    (["encode.cache_max_gib=-1"], "encode.cache_max_gib is -1, which no cache can be held to (give GiB above 0, "),
    (["vae.use=fast", "vae.tile_height=100"], "vae tile 100x256 with overlap 64 is not a tiling"),
    (["mux.x264_preset=warp"], "mux.x264_preset = 'warp' is not one of x264's presets (use one of ultrafast, "),
    (["mux.crf=99"], "mux.crf = 99 is outside x264's 0-51"),
    (["mux.x264_threads=0"], "mux.x264_threads = 0: the encoder takes a fixed count of threads"),
    (["mux.workers=-1"], "mux.workers = -1 is below 0"),
    (["sampler.attention=bogus"], "unknown sampler.attention 'bogus' (choose auto or one of fa3, "),
    (["vae.use=fast", "vae.attention=bogus"], "unknown vae.attention 'bogus' (choose auto or one of fa3, "),
    (["encode.layer=999"], "encode.layer is 999, and the text encoder in "),
    (["cache.use=residual", "sampler.dit=h3gen", "cache.first_blocks=1", "cache.last_blocks=1"],
     "cache.first_blocks + cache.last_blocks (2) leave no middle block of the DiT's 2 to reuse"),
    (["cache.use=schedule", "sampler.dit=h3gen", "cache.steps=[1]"], "steps must include 0"),
    # a backend that exists but cannot run on this device: refused before the weights load, not clip by clip
    (["runtime.device=cpu", "sampler.dit=h3gen", "sampler.attention=flash-attn-4"],
     "sampler.attention = flash-attn-4 cannot run here: it runs on CUDA GPUs only, and this run is on cpu (set "
     "sampler.attention = auto, which picks the fastest backend this machine runs)"),
    (["runtime.device=cpu", "vae.use=fast", "vae.attention=cudnn-fp8"],
     "vae.attention = cudnn-fp8 cannot run here: it runs on CUDA GPUs only"),
    (["sampler.use=diffusers", "sampler.sdpa_backend=bogus"],
     "unknown sampler.sdpa_backend 'bogus' (choose default, flash, cudnn, efficient, math)"),
    (["runtime.device=cpu", "sampler.use=diffusers", "sampler.sdpa_backend=efficient"],
     "sampler.sdpa_backend = efficient runs on CUDA GPUs only, and this run is on cpu"),
    (["sampler.use=diffusers", "sampler.steps=1"], "diffusers' sigma grid needs at least 2 points"),
])
@pytest.mark.parametrize("dry", [False, True])
def test_a_stage_value_it_cannot_run_with_is_refused_before_the_run_a_dry_run_too(prompts_file, tmp_path,
                                                                                 tiny_model, values, message, dry):
    """The stages check their preset values as the run is checked, so a dry run promises no run that then fails;
    neither leaves the output directory it would have made."""
    out = tmp_path / "out"
    settings = [arg for value in values for arg in ("--set", value)]
    refused(h3gen("render", prompts_file("a lighthouse at night\n"), "-o", out, *settings,
                  *(["--dry-run"] if dry else [])), message)
    assert not out.exists()


@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5", ""])
def test_a_thread_count_openmp_cannot_take_is_refused(prompts_file, tmp_path, value):
    refused(h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", env={"OMP_NUM_THREADS": value}, fresh=True),
            f"OMP_NUM_THREADS is {value!r}, not a number of threads (set it to a whole number from 1 up, or unset it)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
@pytest.mark.parametrize("value", ["nonsense", "expandable_segments:True,,", "max_split_size_mb:"])
def test_an_allocator_setting_torch_cannot_read_is_refused_before_torch_stops(prompts_file, tmp_path, name, value):
    """torch aborts as it is imported on these (SIGABRT, a C++ traceback): even a dry run."""
    refused(h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--dry-run", env={name: value}, fresh=True),
            f"{name} is {value!r}, which torch cannot read (it stops as it starts) (give comma-separated key:value "
            "entries, as expandable_segments:True, or unset it)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["abc", "-5", "nan"])
def test_a_heartbeat_that_is_not_seconds_is_refused(prompts_file, tmp_path, value):
    out = tmp_path / "out"
    refused(h3gen("render", prompts_file("a lighthouse at night\n"), "-o", out, env={"H3GEN_HEARTBEAT_S": value}),
            f"H3GEN_HEARTBEAT_S is '{value}', not a number of seconds from 0 up")
    assert not out.exists()


def test_a_dry_run_leaves_no_directory_behind(prompts_file, tmp_path, tiny_model):
    out = tmp_path / "new" / "out"
    planned = h3gen("render", prompts_file("a lighthouse at night\n"), "-o", out, "--dry-run", check_code=0)
    assert planned.stdout.startswith("render ") and not (tmp_path / "new").exists()


def test_a_dry_run_changes_nothing_and_says_busy_for_a_clip_a_live_run_holds(prompts_file, tmp_path):
    from h3gen.run.outputs import ClipClaim

    out, prompts = tmp_path / "out", prompts_file("a lighthouse at night\nwaves on rocks\n")
    out.mkdir()
    first, second = (json.loads(line)["path"] for line in h3gen("render", prompts, "-o", out, "--dry-run", "--json",
                                                                   check_code=0).stdout.splitlines())
    # What a killed run left beside the first clip: its partial MP4 and its lock, held by nobody now.
    left = [out / f".{first.rsplit('/', 1)[1]}{suffix}" for suffix in (".partial.mp4", ".lock")]
    for path in left:
        path.write_bytes(b"left by a killed run")
    live = ClipClaim(out / second.rsplit("/", 1)[1])  # a live run rendering the second
    assert live.acquire()
    try:
        planned = h3gen("render", prompts, "-o", out, "--dry-run", "--json", check_code=0)
    finally:
        live.release()
    actions = [(r["action"], r["error"]) for r in map(json.loads, planned.stdout.splitlines())]
    assert actions == [("render", None), ("busy", None)]
    assert all(path.read_bytes() == b"left by a killed run" for path in left)  # the run clears them, not a dry run
    h3gen("render", prompts, "-o", out, check_code=0)
    assert not any(path.exists() for path in left)


def test_a_clip_another_run_renders_with_other_settings_is_a_conflict_not_busy(prompts_file, tmp_path):
    """Two runs ask for one file name (an id) with different seeds: the second does not count the first's clip as its
    own, in its dry run nor in its run."""
    from h3gen.run import fingerprint
    from h3gen.run.outputs import ClipClaim

    out, prompts = tmp_path / "out", prompts_file('{"id": "clash", "prompt": "a fox", "seed": 6}\n')
    h3gen("render", prompts, "-o", out, check_code=0)
    fields = fingerprint.read_stamp(out / "clash.mp4")
    (out / "clash.mp4").unlink()
    live = ClipClaim(out / "clash.mp4")
    for seed, action, code in ((5, "conflict", 1), (6, "busy", 0)):
        assert live.acquire({**fields, "request.seed": seed})
        try:
            planned = json.loads(h3gen("render", prompts, "-o", out, "--dry-run", "--json", check_code=code).stdout)
            result = h3gen("render", prompts, "-o", out, "--json", check_code=code)
        finally:
            live.release()
        assert planned["action"] == action
        record = json.loads(result.stdout)
        assert (record["status"], record["ok"]) == (action, action == "busy")
        if action == "conflict":
            why = ("another h3gen run is rendering it with other settings (request.seed: 5 -> 6); when that run ends, "
                   "--redo-conflicts renders this one over it; or give the prompt another id, or -o elsewhere")
            assert planned["error"] == why and record["error"] == why
    assert not (out / "clash.mp4").exists()


@pytest.mark.parametrize("stream, message", [("/dev/zero", "/dev/zero:1: a NUL byte, so not UTF-8 text"),
                                             ("/dev/urandom", "/dev/urandom:1: not UTF-8 text (more than 256 bytes")])
def test_an_endless_stream_is_refused_at_its_first_chunk(tmp_path, stream, message):
    refused(h3gen("render", stream, "-o", tmp_path / "out", "--dry-run"), message)


def test_a_prompts_file_past_any_prompts_file_s_size_is_refused_as_it_is_read(tmp_path, monkeypatch):
    from h3gen.inputs import prompts

    monkeypatch.setattr(prompts, "MAX_PROMPTS_BYTES", 2 << 20)  # 2 MiB instead of 1 GiB, read in 1 MiB chunks
    big = tmp_path / "weights.safetensors"
    big.write_bytes(b"a prompt\n" * (1 << 20) + b"\xff")  # 10 MiB, the bad byte past the size
    with pytest.raises(prompts.UsageError, match=r"weights.safetensors holds more than 0.00195312 GiB, which no "):
        prompts.prompts_bytes(big)


def test_unreadable_prompts_file(tmp_path, monkeypatch):
    """As root every file is readable, so the refusal of the operating system is simulated in process."""
    from pathlib import Path

    from h3gen.cli.main import app

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("x\n")
    real = Path.open

    def open_path(path, *args, **kwargs):
        if path == prompts:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_path)
    result = CliRunner().invoke(app, ["render", str(prompts), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert f"prompts file {prompts} is not readable (check its permissions)" in result.output


def test_prompts_file_that_is_a_directory(tmp_path):
    refused(h3gen("render", tmp_path, "-o", tmp_path / "out"), "is a directory")


def test_a_preset_in_the_prompts_files_place_is_named_as_one(tmp_path):
    preset = tmp_path / "mine.toml"
    preset.write_text('version = 1\nextends = "tiny"\n')  # no table: every line would read as a prompt
    refused(h3gen("render", preset, "-o", tmp_path / "out"),
            f"prompts file {preset} is a TOML file, which is how presets are written (pass it as --preset {preset}")


@pytest.mark.parametrize("change, message", [
    (lambda t: t.replace("steps = 4", "steps = 4 4"), "is not valid TOML: Expected newline or end of document "
                                                      "after a statement (at line 21, column 11)"),
    (lambda t: t.replace("[sampler]\n", "[sampler]\nwobble = 1\n"), "unknown key 'wobble' in preset bad [sampler]"),
    (lambda t: t.replace('use = "euler"', 'use = "fancy"'), "unknown sampler stage 'fancy' (registered sampler stages:"),
    (lambda t: t.replace("steps = 4", "steps = 4.5"), "preset bad [sampler].steps must be int, got 4.5"),
    (lambda t: t.replace("version = 1", "version = 2"), "preset bad has version 2, which this h3gen does not know"),
    (lambda t: t.replace("version = 1", 'version = "1"'), "preset bad has version '1', which is not a whole number "
                                                        "(write version = 1, without quotes)"),
    (lambda t: t.replace('[quant]\nuse = "none"', '[quant]\nuse = "fp8-rowwise"\nroles = ["dit", "bogus"]'),
     "preset bad [quant]: unknown role 'bogus' in roles (roles are dit, text_encoder, vae)"),
    (lambda t: t.replace("version = 1\n", ""), "preset bad has no version (add version = 1 at its top)"),
    (lambda t: t.replace("version = 1\n", "version = 1\ndeep = %s%s\n" % ("[" * 1200, "]" * 1200)),
     "preset bad nests its values too deeply to read (write each key's value as a number, a string or a list of them)"),
    (lambda t: t.replace('dtype = "float32"', 'dtype = "float64"'),
     "preset bad [runtime] dtype 'float64' is not a supported dtype"),
    (lambda t: t.replace('device = "auto"', 'device = "tpu"'), "preset bad [runtime] device 'tpu' is not a device "
                                                              "h3gen runs on (use auto, cpu, cuda or cuda:N)"),
    (lambda t: "request = 3\n" + t.replace("[request]\nwidth = 32\nheight = 32\nduration = 5.0\n", ""),
     "request must be a table, got 3"),
])
def test_bad_preset_file_is_refused(prompts_file, tmp_path, change, message):
    preset = tmp_path / "bad.toml"
    preset.write_text(change(TINY_PRESET))
    refused(h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--preset", preset),
            message.replace("preset bad", f"preset {preset}"))  # a preset file is named by its path


@pytest.mark.parametrize("setting, message", [
    ("runtime.device=tpu", "--set runtime.device=tpu is not a device h3gen runs on (use auto, cpu, cuda or cuda:N)"),
    ("runtime.dtype=float64", "--set runtime.dtype=float64 is not a supported dtype"),
    ("model.needs=foo", "--set model.needs=foo is not a model kind"),
    ("parallel.gpus=-1", "--set parallel.gpus=-1: give a whole number >= 0"),
    ("mux.crf=99", "--set mux.crf: mux.crf = 99 is outside x264's 0-51"),  # a stage's own check of its section
    ("mux.x264_threads=0", "--set mux.x264_threads: mux.x264_threads = 0: the encoder takes a fixed count of threads "
                           "(give 1 or more: x264's own 0 picks by the machine"),  # a key with a digit in it
    ("sampler.steps=1", "--set sampler.steps: the sigma grid needs at least 2 points"),
    ("adapter.scale=abc", "--set adapter.scale must be float, got 'abc' (fix the value after the =)"),
    ("adapter.paths=%s%s" % ("[" * 1200, "]" * 1200), "--set adapter.paths: its value nests too deeply to read (give a "
                                                      "number, a string or a list of them)"),
    ('adapter.tasks=["t2v"]', "--set adapter.tasks: unknown task 't2v' in tasks (tasks are t2va, fl2va, ref2va)"),
    ("cache.use=residual", '--set cache.use=residual: the step cache runs on sampler.dit = "h3gen"'),
    ("model.needs=MiniMax-H3", "--set model.needs=MiniMax-H3, and no --model was given, so the embedded tiny model "
                               "stands in (leave out --set model.needs, or pass --model DIR with the model it names)"),
])
def test_a_bad_set_value_is_said_as_the_set(prompts_file, tmp_path, setting, message):
    """The --set gave it, not the preset: the error says so."""
    refused(h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--set", setting), message)


@pytest.mark.parametrize("line, message", [
    ("ffn_chunk_rows = -1", "preset bad [sampler]: sampler.ffn_chunk_rows is -1 (set it to 0 (all rows at once) or a "
                            "positive row count)"),
    ('dit = "fancy"', "preset bad [sampler]: unknown sampler.dit 'fancy' (choose diffusers or h3gen)"),
    ('use = "nope"', "preset bad [sampler]: unknown sampler stage 'nope' (registered sampler stages: diffusers, euler)"),
])
def test_bad_sampler_value_is_refused_before_any_weight_loads(prompts_file, tmp_path, line, message):
    """Values of a stage's own section are checked as the stage is built, before it loads or claims a clip."""
    preset = tmp_path / "bad.toml"
    sampler = TINY_PRESET.replace('dit = "diffusers"\n', "") if line.startswith("dit") else TINY_PRESET
    sampler = sampler.replace('use = "euler"\n', "") if line.startswith("use") else sampler
    preset.write_text(sampler.replace("[sampler]\n", f"[sampler]\n{line}\n"))
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--preset", preset, check_code=2)
    named = message.replace("preset bad", f"preset {preset}")  # a preset file is named by its path
    named = named[:-1] + left_out_note() + ")" if line.startswith("use") else named
    assert result.stderr.strip().splitlines()[-1] == f"h3gen: error: {named}"
    assert not list((tmp_path / "out").glob("**/*.mp4"))


def test_preset_naming_a_python_object_imports_nothing(prompts_file, tmp_path):
    """`use` is looked up among registered stage names only; a module path is never imported."""
    site, marker = tmp_path / "site", tmp_path / "imported"
    site.mkdir()
    (site / "h3gen_bait.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Sampler: pass\n")
    preset = tmp_path / "bait.toml"
    preset.write_text(TINY_PRESET.replace('use = "euler"', 'use = "h3gen_bait:Sampler"'))
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--preset", preset,
                   env={"PYTHONPATH": str(site)})
    refused(result, "unknown sampler stage 'h3gen_bait:Sampler'")
    assert not marker.exists()


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    return copy


class PickleBait:
    """Unpickling this runs code: it creates the marker file named at pickling time."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def test_pickle_only_checkpoint_is_refused_and_never_unpickled(model_copy, prompts_file, tmp_path):
    marker = tmp_path / "unpickled"
    weights = model_copy / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.unlink()
    weights.with_suffix(".bin").write_bytes(pickle.dumps(PickleBait(marker)))
    out = tmp_path / "out"
    result = h3gen("render", prompts_file("x\n"), "-o", out, "--model", model_copy, "--preset", "tiny")
    refused(result, "diffusion_pytorch_model.bin is a pickle checkpoint; h3gen loads safetensors only")
    assert not marker.exists() and not list(out.glob("*.mp4"))


def test_pickles_and_remote_code_in_the_model_directory_are_never_run(model_copy, prompts_file, tmp_path):
    """Pickled weights beside the safetensors, and every config pointing auto_map at a module beside it with
    trust_remote_code set: the clip renders from the safetensors and none of that code runs."""
    marker = tmp_path / "code-ran"
    for folder, name in (("transformer", "diffusion_pytorch_model.bin"), ("vae", "diffusion_pytorch_model.bin"),
                         ("text_encoder", "pytorch_model.bin")):
        (model_copy / folder / name).write_bytes(pickle.dumps(PickleBait(marker)))
    bait = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\nclass Bait: pass\n"
    auto_maps = {
        "text_encoder/config.json": {"AutoConfig": "bait.Bait", "AutoModel": "bait.Bait",
                                     "AutoModelForImageTextToText": "bait.Bait"},
        "tokenizer/tokenizer_config.json": {"AutoTokenizer": ["bait.Bait", "bait.Bait"]},
        "processor/processor_config.json": {"AutoProcessor": "bait.Bait"},
        "transformer/config.json": {"AutoModel": "bait.Bait"},
        "vae/config.json": {"AutoModel": "bait.Bait"},
        "audio_vae/config.json": {"AutoModel": "bait.Bait"},
    }
    for relative, auto_map in auto_maps.items():
        config_path = model_copy / relative
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**config, "auto_map": auto_map, "trust_remote_code": True}))
        (config_path.parent / "bait.py").write_text(bait)
    out = tmp_path / "out"
    h3gen("render", prompts_file("x\n"), "-o", out, "--model", model_copy, "--preset", "tiny", check_code=0)
    assert not marker.exists(), marker.read_text()
    assert len(list(out.glob("*.mp4"))) == 1


def test_a_bf16_preset_on_the_cpu_leaks_no_library_warning(prompts_file, tmp_path):
    """h3-exact on the tiny model: bf16 activations meet the checkpoint's fp32 norm weights in torch's CPU RMSNorm,
    which warns that it takes its unfused path; the user's log gets only h3gen's lines."""
    result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", "--preset", "h3-exact", "--set",
                   "model.needs=any", "--set", "request.width=32", "--set", "request.height=32", check_code=0)
    assert "Warning" not in result.stderr and "warn(" not in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--preset", ""], "--preset is empty (give a preset name or file, or leave --preset out)"),
    (["--force", "--redo-conflicts"], "--force and --redo-conflicts both given"),
])
def test_options_that_cannot_mean_anything_together_are_refused(prompts_file, tmp_path, args, message):
    result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", "--dry-run", *args, check_code=2)
    assert result.stderr.startswith(f"h3gen: error: {message}") and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["render", "PROMPTS", "--dry-run"], ["bench", "--preset", "tiny"]])
def test_an_empty_output_directory_is_refused_not_read_as_the_current_one(prompts_file, tmp_path, command):
    """`-o "$OUT"` with OUT unset: refused, nothing written where the command ran."""
    args = [str(prompts_file("a fox\n")) if arg == "PROMPTS" else arg for arg in command]
    result = h3gen(*args, "-o", "", cwd=tmp_path, check_code=2)
    assert result.stderr == "h3gen: error: -o is empty (give the directory to write to; for this one, -o .)\n"
    assert result.stdout == ""
