"""The render fingerprint: a rerun skips a clip only when what decides its bytes is what the clip was rendered with."""

import dataclasses
import json
import re
import shutil

import pytest

from conftest import h3gen
from h3gen.run import fingerprint


def conflicts(result) -> list[str]:
    """The clip's own line (the summary repeats it)."""
    return [line for line in result.stderr.splitlines()
            if re.search(r"^\S+ \S+ \[1/1\] .*exists, rendered with different settings \(", line)]


def test_a_rerun_skips_only_on_a_matching_fingerprint(prompts_file, tmp_path, tiny_model):
    prompts = prompts_file('{"id": "c", "prompt": "a lighthouse at night", "seed": 3}\n')
    out = tmp_path / "out"
    first = h3gen("render", prompts, "-o", out, "--json", check_code=0)
    clip = (out / "c.mp4").read_bytes()
    written = json.loads(first.stdout)
    with __import__("av").open(str(out / "c.mp4")) as container:
        stored = json.loads(container.metadata["comment"])
    assert stored["h3gen_fingerprint"] == written["fingerprint"] == fingerprint.digest(stored["fields"])

    same = h3gen("render", prompts, "-o", out, "--json", check_code=0)
    assert json.loads(same.stdout)["status"] == "skipped" and not conflicts(same)

    other_model = tmp_path / "other-model"
    shutil.copytree(tiny_model, other_model)
    config = other_model / "transformer" / "config.json"
    config.write_text(config.read_text().replace('"norm_eps": 1e-05', '"norm_eps": 1e-06'))

    def other(line: str):
        path = tmp_path / f"other-{len(list(tmp_path.glob('other-*')))}.txt"
        path.write_text(line + "\n")
        return path

    changed = {"preset value": (prompts, "--set", "sampler.steps=3"),
               "request": (other('{"id": "c", "prompt": "a lighthouse at night", "seed": 4}'),),
               "model": (prompts, "--model", other_model, "--preset", "tiny"),
               "duration": (other('{"id": "c", "prompt": "a lighthouse at night", "seed": 3, "duration": 6}'),)}
    for what, args in changed.items():
        rerun = h3gen("render", args[0], "-o", out, "--json", *args[1:], check_code=1)
        record = json.loads(rerun.stdout)
        assert record["status"] == "conflict" and not record["ok"], what
        [line] = conflicts(rerun)
        assert "; --redo-conflicts to render these again, --force every clip, or -o elsewhere" in line, what
        assert "1 in conflict with a file there (other settings, or not h3gen's" in rerun.stderr, what
    assert record_error(out, 2).count(" -> ") == 1 and "sampler.steps: 4 -> 3" in record_error(out, 2)
    assert record_error(out, 3).count(" -> ") == 1 and "request.seed: 3 -> 4" in record_error(out, 3)
    assert "model: " in record_error(out, 4)
    # another duration: a conflict, not a clip of the wrong length to render over
    assert record_error(out, 5).count(" -> ") == 2 and ("request.frames: 124 -> 158 (duration 5.17 s -> 6.58 s)"
                                                         in record_error(out, 5))
    manifest = [json.loads(line)["status"] for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert manifest == ["ok", "skipped", "conflict", "conflict", "conflict", "conflict"]
    assert (out / "c.mp4").read_bytes() == clip  # a conflict leaves the clip as it was

    (out / "c.mp4").write_bytes(clip[: len(clip) // 2])  # a damaged clip is named, and rendered again
    checked = h3gen("validate", out / "c.mp4", check_code=1)
    assert re.fullmatch(r"\S+c\.mp4: INVALID: truncated.*; the h3gen render that wrote it renders it again when run "
                        r"once more\n", checked.stderr), checked.stderr
    planned = h3gen("render", prompts, "-o", out, "--dry-run", check_code=0)
    assert re.match(r"render +\S+c\.mp4: there but damaged: .*; rendered again$", planned.stdout.strip())
    redone = h3gen("render", prompts, "-o", out, "--json", check_code=0)
    assert json.loads(redone.stdout)["status"] == "ok"
    assert re.search(r"note: \S+c\.mp4 is there but damaged: .*truncated.*; rendered again", redone.stderr)
    assert (out / "c.mp4").read_bytes() == clip
    checked = h3gen("validate", out / "c.mp4", "--frames", "1000", check_code=1)  # whole: a rerun keeps it
    assert checked.stderr.endswith("expected 1000\n"), checked.stderr


def test_the_same_preset_under_another_name_renders_the_same_clip(prompts_file, tmp_path):
    """The preset counts by its values: a copy of it under another name skips what the original wrote, and a clip
    stamped with the preset's name (as earlier versions stamped) is no conflict for that either."""
    prompts = prompts_file('{"id": "c", "prompt": "a lighthouse at night", "seed": 3}\n')
    out, renamed = tmp_path / "out", tmp_path / "mytiny.toml"
    renamed.write_text('version = 1\nextends = "tiny"\n')
    h3gen("render", prompts, "-o", out, check_code=0)
    again = h3gen("render", prompts, "-o", out, "--json", "--preset", renamed, check_code=0)
    assert json.loads(again.stdout)["status"] == "skipped"
    fields = fingerprint.read_stamp(out / "c.mp4")
    assert "preset" not in fields and fingerprint.differences(dict(fields, preset="tiny"), fields) == []


def test_a_whole_mp4_h3gen_did_not_write_is_left_alone(prompts_file, tmp_path):
    import av
    import numpy as np

    out = tmp_path / "out"
    out.mkdir()
    with av.open(str(out / "drums.mp4"), "w") as container:  # video only, no stamp
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(4):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 40 * i, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    before = (out / "drums.mp4").read_bytes()
    planned = h3gen("render", prompts_file('{"id": "drums", "prompt": "drums"}\n'), "-o", out, "--dry-run",
                    check_code=1)
    assert re.match(r"conflict +\S+drums\.mp4: exists, a whole MP4 h3gen did not stamp \(.*\); move it away to "
                    r"render this clip, --force", planned.stdout.strip()), planned.stdout
    assert (out / "drums.mp4").read_bytes() == before
    # --redo-conflicts renders again only the clips h3gen stamped: a file of the user's own stays
    kept = h3gen("render", prompts_file('{"id": "drums", "prompt": "drums"}\n'), "-o", out, "--redo-conflicts",
                 check_code=1)
    assert "a whole MP4 h3gen did not stamp" in kept.stderr and (out / "drums.mp4").read_bytes() == before


def test_a_file_that_is_not_an_mp4_is_never_rendered_over_but_by_force(prompts_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    theirs = {"film": b"\x1aE\xdf\xa3" + bytes(range(256)) * 40,  # a Matroska file's first bytes
              "notes": b"my notes\n", "noise": bytes(range(7, 256)) * 200}
    for name, data in theirs.items():
        (out / f"{name}.mp4").write_bytes(data)
    (out / "gone.mp4").symlink_to(tmp_path / "unmounted" / "gone.mp4")
    (out / "empty.mp4").write_bytes(b"")  # a copy that stopped before its first byte: rendered again
    prompts = prompts_file("".join(f'{{"id": "{name}", "prompt": "{name}"}}\n'
                                   for name in (*theirs, "gone", "empty")))
    planned = h3gen("render", prompts, "-o", out, "--dry-run", check_code=1).stdout.splitlines()
    for name in theirs:
        assert any(re.match(rf"conflict +\S+{name}\.mp4: exists, a file that is not an MP4 \(it does not start "
                            r"with an ftyp box\); move it away to render this clip, --force", line)
                   for line in planned), planned
    assert any(re.match(r"conflict +\S+gone\.mp4: exists, not a file \(a link to \S+gone\.mp4, which is missing\); "
                        r"restore what it points to, --force to replace the link", line) for line in planned), planned
    assert any(re.match(r"render +\S+empty\.mp4", line) for line in planned), planned
    for redo in ("--redo-conflicts", None):
        h3gen("render", prompts, "-o", out, *([redo] if redo else []), check_code=1)
        assert {name: (out / f"{name}.mp4").read_bytes() for name in theirs} == theirs
        assert (out / "gone.mp4").is_symlink() and (out / "empty.mp4").stat().st_size > 0
    h3gen("render", prompts, "-o", out, "--force", check_code=0)
    assert all((out / f"{name}.mp4").read_bytes()[4:8] == b"ftyp" for name in (*theirs, "gone"))
    assert not (out / "gone.mp4").is_symlink()


def test_a_valid_clip_without_the_stamp_is_not_said_to_be_from_other_settings(prompts_file, tmp_path):
    import av

    prompts, out = prompts_file('{"id": "drums", "prompt": "drums"}\n'), tmp_path / "out"
    h3gen("render", prompts, "-o", out, check_code=0)
    stamped, bare = out / "drums.mp4", tmp_path / "bare.mp4"
    with av.open(str(stamped)) as source, av.open(str(bare), "w") as copy:  # the same streams, no metadata
        streams = {s.index: copy.add_stream_from_template(s) for s in source.streams}
        for packet in source.demux():
            if packet.dts is not None:
                packet.stream = streams[packet.stream.index]
                copy.mux(packet)
    bare.replace(stamped)
    planned = h3gen("render", prompts, "-o", out, "--dry-run", check_code=1).stdout.strip()
    assert re.match(r"conflict +\S+drums\.mp4: exists, a whole MP4 h3gen did not stamp \(no h3gen stamp in its "
                    r"metadata\); move it away to render this clip, --force", planned), planned


def test_redo_conflicts_renders_only_the_clips_from_other_settings(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('{"id": "a", "prompt": "a fox"}\n{"id": "b", "prompt": "waves", "seed": 5}\n')
    only_b = tmp_path / "only-b.txt"
    only_b.write_text('{"id": "b", "prompt": "waves", "seed": 5}\n')
    out = tmp_path / "out"
    h3gen("render", prompts, "-o", out, check_code=0)
    h3gen("render", only_b, "-o", out, "--set", "mux.crf=30", "--force", check_code=0)  # b now from other settings
    b_before = (out / "b.mp4").read_bytes()
    planned = h3gen("render", prompts, "-o", out, "--dry-run", "--redo-conflicts", check_code=0).stdout.split()
    assert planned[0::2] == ["skip", "render"]
    again = h3gen("render", prompts, "-o", out, "--json", "--redo-conflicts", check_code=0)
    assert [(r["id"], r["status"]) for r in map(json.loads, again.stdout.splitlines())] == [("a", "skipped"),
                                                                                            ("b", "ok")]
    assert (out / "b.mp4").read_bytes() != b_before
    assert json.loads(h3gen("render", only_b, "-o", out, "--json", check_code=0).stdout)["status"] == "skipped"


def record_error(out, index: int) -> str:
    return json.loads((out / "manifest.jsonl").read_text().splitlines()[index])["error"]


def test_stage_versions_and_adapter_files_are_fields(tmp_path):
    from h3gen.config.preset import resolve
    from h3gen.plugins.manager import registry

    class Versioned:
        version = "2.1"

    class Unversioned:
        pass

    Unversioned.__module__ = "h3gen.stages.somewhere"
    assert fingerprint.stage_version(Versioned) == "2.1"
    assert fingerprint.stage_version(Unversioned) == f"h3gen/{fingerprint.RENDER_VERSION}"

    found = registry()
    preset = resolve("tiny", found)
    repo = type("Repo", (), {"root": tmp_path})()
    base = fingerprint.run_fields(preset, found, repo)
    adapter = tmp_path / "style.safetensors"
    adapter.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with_adapter = dataclasses.replace(preset, adapter=dataclasses.replace(preset.adapter, paths=[str(adapter)]))
    first = fingerprint.run_fields(with_adapter, found, repo)
    adapter.write_bytes(b"\x03\x00\x00\x00\x00\x00\x00\x00{} ")
    second = fingerprint.run_fields(with_adapter, found, repo)
    assert len({fingerprint.digest(f) for f in (base, first, second)}) == 3
    assert fingerprint.differences(first, second)[0].startswith("adapter.file0: ")

    folder = tmp_path / "peft"  # a PEFT folder: its adapter_config.json scales the delta, so it counts too
    folder.mkdir()
    adapter.rename(folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text('{"lora_alpha": 8}')
    in_folder = dataclasses.replace(preset, adapter=dataclasses.replace(preset.adapter, paths=[str(folder)]))
    eight = fingerprint.run_fields(in_folder, found, repo)
    (folder / "adapter_config.json").write_text('{"lora_alpha": 4}')
    [line] = fingerprint.differences(eight, fingerprint.run_fields(in_folder, found, repo))
    assert line.startswith("adapter.config0: ")


def test_the_same_model_in_another_cache_folder_is_the_same_model(tmp_path, tiny_model, monkeypatch):
    """A saved modular_model_index.json records the repository's own path: the tiny model written in another cache
    folder (another user, another XDG_CACHE_HOME) must not make every clip rendered with it a conflict."""
    from h3gen.models.tiny import ensure_tiny_model

    elsewhere = ensure_tiny_model(tmp_path / "cache" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert str(elsewhere) in (elsewhere / "modular_model_index.json").read_text()
    assert fingerprint.model_identity(str(elsewhere)) == fingerprint.model_identity(str(tiny_model))
    (tmp_path / "link").symlink_to(elsewhere)
    for named in (elsewhere.relative_to(tmp_path), tmp_path / "link"):  # a relative path, and a link to the folder
        fingerprint.model_identity.cache_clear()
        assert fingerprint.model_identity(str(named)) == fingerprint.model_identity(str(tiny_model)), named
    import shutil

    shutil.copytree(elsewhere, tmp_path / "copied", symlinks=True)
    shutil.copytree(elsewhere, tmp_path / "to-move", symlinks=True)
    shutil.move(tmp_path / "to-move", tmp_path / "moved")
    for moved in (tmp_path / "copied", tmp_path / "moved"):  # as cp -r and mv leave it: the old path inside
        fingerprint.model_identity.cache_clear()
        assert str(elsewhere) in (moved / "modular_model_index.json").read_text()
        assert fingerprint.model_identity(str(moved)) == fingerprint.model_identity(str(tiny_model)), moved
    config = elsewhere / "transformer" / "config.json"
    config.write_text(config.read_text().replace('"norm_eps": 1e-05', '"norm_eps": 1e-06'))
    fingerprint.model_identity.cache_clear()
    assert fingerprint.model_identity(str(elsewhere)) != fingerprint.model_identity(str(tiny_model))


def test_a_model_card_edited_or_added_changes_no_clip(tmp_path, tiny_model):
    """A re-downloaded repository whose README, license or figures changed renders the same clips; a clip stamped
    when every file counted is still the same model's while the repository is as it was."""
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    fingerprint.model_identity.cache_clear()
    identity = fingerprint.model_identity(str(copy))
    stamped_before = fingerprint.COUNTING_EVERY_FILE[identity]  # the tiny model has a README.md
    assert stamped_before != identity
    assert fingerprint.differences({"model": stamped_before}, {"model": identity}) == []
    (copy / "README.md").write_text("# MiniMax-H3\n\nan edited model card\n")
    (copy / "LICENSE").write_text("terms\n")
    (copy / "figures").mkdir()
    (copy / "figures" / "teaser.png").write_bytes(b"\x89PNG")
    fingerprint.model_identity.cache_clear()
    assert fingerprint.model_identity(str(copy)) == identity
    assert fingerprint.differences({"model": stamped_before}, {"model": identity}) == [
        f"model: {stamped_before} -> {identity}"]  # stamped over the card as it was: its change shows there
    (copy / "processor" / "chat_template.jinja").write_text("{{ messages }}")  # what a loader reads counts
    fingerprint.model_identity.cache_clear()
    assert fingerprint.model_identity(str(copy)) != identity


def test_weights_retrained_at_the_same_shapes_are_another_model(tmp_path, tiny_model):
    """One byte of one tensor changed, 50 bytes before the file's end: same sizes, same headers, another model."""
    copy = tmp_path / "flip"
    shutil.copytree(tiny_model, copy)
    weights = copy / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-50] ^= 0xFF
    weights.write_bytes(bytes(data))
    fingerprint.model_identity.cache_clear()
    assert fingerprint.model_identity(str(copy)) != fingerprint.model_identity(str(tiny_model))


def test_a_large_safetensors_file_counts_by_its_header_and_samples_reaching_its_end(tmp_path, tiny_model):
    """Past the size read whole: the header and samples spread over the tensors, the last ending at the file's end."""
    weights = tmp_path / "w.safetensors"
    original = (tiny_model / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    weights.write_bytes(original)
    summary = fingerprint.file_summary(weights, whole_bytes=1024)
    assert summary != original and summary.startswith(original[:8])
    data = bytearray(original)
    data[-50] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert fingerprint.file_summary(weights, whole_bytes=1024) != summary


@pytest.mark.parametrize("flag", [[], ["--force"]])
def test_a_directory_where_the_clip_goes_is_a_conflict_before_anything_renders(prompts_file, tmp_path, flag):
    prompts, out = prompts_file('{"id": "dog", "prompt": "a dog"}\n{"id": "cat", "prompt": "a cat"}\n'), tmp_path / "out"
    (out / "dog.mp4").mkdir(parents=True)
    planned = h3gen("render", prompts, "-o", out, "--dry-run", *flag, check_code=1).stdout.splitlines()
    assert re.match(r"conflict +\S+dog\.mp4: exists, not a file \(a directory\); move it away, or -o elsewhere$",
                    planned[0]), planned
    result = h3gen("render", prompts, "-o", out, "--json", *flag, check_code=1)
    assert [(r["id"], r["status"]) for r in map(json.loads, result.stdout.splitlines())] == [("dog", "conflict"),
                                                                                            ("cat", "ok")]
    assert "sampler" not in json.loads(result.stdout.splitlines()[0]).get("seconds", {})


def test_a_stage_swapped_is_the_first_difference_said():
    """Its own keys change with it; the conflict line shows three differences, so the swap comes first."""
    old = {"vae.use": "reference 1", "vae.attention": None, "vae.compile": None, "vae.exact": None, "mux.crf": 18}
    new = {"vae.use": "fast 1", "vae.attention": "sdpa", "vae.compile": False, "vae.exact": False, "mux.crf": 18}
    assert fingerprint.differences(old, new)[:2] == ["vae.use: reference 1 -> fast 1", "vae.attention: (none) -> sdpa"]


def test_a_key_that_only_moved_with_a_wrapper_added_or_taken_away_is_not_a_difference():
    """Unwrapping the mux moves its keys from mux.wraps to mux: the swap is the difference, not crf's new place, and
    a key that changed too is said from its old place."""
    wrapped = {"mux.use": "sidecar 1", "mux.wraps.use": "pyav 1", "mux.wraps.crf": 18, "mux.wraps.preset": "slow"}
    plain = {"mux.use": "pyav 1", "mux.crf": 18, "mux.preset": "medium"}
    assert fingerprint.differences(wrapped, plain) == ["mux.use: sidecar 1 -> pyav 1", "mux.preset: slow -> medium"]
    assert fingerprint.differences(plain, wrapped) == ["mux.use: pyav 1 -> sidecar 1", "mux.wraps.use: (none) -> pyav 1",
                                                       "mux.wraps.preset: medium -> slow"]


def test_the_encoder_s_token_limit_is_not_part_of_the_fingerprint(tiny_model):
    """Raising encode.max_tokens lets a longer prompt render; the clips already written stay this run's."""
    from h3gen.config.preset import resolve
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import registry

    fields = [fingerprint.run_fields(resolve("tiny", registry(), overrides), registry(), ModelRepo(tiny_model))
              for overrides in ([], ["encode.max_tokens=2048"], ["encode.layer=1"])]
    assert fields[0] == fields[1] and fields[0] != fields[2]


def test_a_field_only_the_clip_carries_decides_nothing():
    """A clip stamped before a key left the fingerprint (the preset's name, encode.max_tokens) is still this run's;
    a field only this run has is a difference."""
    new = {"sampler.steps": 4, "encode.use": "qwen3vl 1"}
    assert fingerprint.differences(new | {"preset": "tiny", "encode.max_tokens": 1024}, new) == []
    [line] = fingerprint.differences(new, new | {"encode.layer": 49})
    assert line.startswith("encode.layer: ") and line.endswith(" -> 49")


def test_an_empty_string_in_a_difference_reads_as_one():
    [line] = fingerprint.differences({"mux.note": "violin"}, {"mux.note": ""})
    assert line == 'mux.note: violin -> ""'


def test_a_clip_s_media_is_read_once_for_its_name_and_fingerprint_and_again_once_it_changes(tmp_path, monkeypatch):
    import os

    from h3gen.inputs.request import Request
    from h3gen.run.resume import clip_name

    frame = tmp_path / "first.png"
    frame.write_bytes(b"frame one")
    reads = []
    summary = fingerprint.file_summary
    monkeypatch.setattr(fingerprint, "file_summary", lambda path: reads.append(path) or summary(path))
    request = Request(index=0, prompt="p", seed=1, width=32, height=32, frames=5, first_frame=frame)
    name, fields = clip_name(request, "tiny"), fingerprint.clip_fields({}, request)
    assert len(reads) == 1 and clip_name(request, "tiny") == name
    frame.write_bytes(b"frame two")  # the same size, written again: its modification time moves
    os.utime(frame, ns=(os.stat(frame).st_atime_ns, os.stat(frame).st_mtime_ns + 1))
    assert clip_name(request, "tiny") != name and fingerprint.clip_fields({}, request) != fields
    assert len(reads) == 2


def test_a_rerun_checks_a_clip_it_stamped_for_damage_without_decoding_its_pictures(tmp_path):
    """Decoding every picture of every clip there would make a nightly rerun over a growing file cost hours: a clip
    stamped with these settings is checked but for its pictures, so a grey one (which `h3gen validate` refuses) is
    skipped; an unstamped one is decoded whole, as before."""
    import numpy as np

    from h3gen.inputs.request import Request
    from h3gen.run.resume import already_done, clip_name
    from h3gen.stages.mux import write_mp4

    request = Request(index=0, prompt="p", seed=1, width=32, height=32, frames=22)
    grey, sound = np.full((22, 32, 32, 3), 128, np.uint8), np.sin(np.arange(29334) / 9)[None].repeat(2, 0) * 0.5
    path = tmp_path / clip_name(request, "tiny")
    write_mp4(path, grey, sound, comment=fingerprint.stamp(fingerprint.clip_fields({}, request)))
    assert already_done(request, tmp_path, "tiny", False, {}).status == "skipped"
    write_mp4(path, grey, sound)
    found = already_done(request, tmp_path, "tiny", False, {})
    assert found.status == "conflict" and "video is constant" in found.error


def test_a_rerun_reads_a_clip_the_manifest_holds_the_sha256_of_once(tmp_path, monkeypatch):
    """Bytes equal to those h3gen wrote whole need no demux besides: hashing them is the whole check, so a rerun reads
    each clip once. One byte changed is damaged all the same; a clip without a sha256 in the manifest (an older
    h3gen's) is demuxed as before."""
    import hashlib

    import numpy as np

    from h3gen.inputs.request import Request
    from h3gen.run import resume
    from h3gen.run.validate import validate_clip
    from h3gen.stages.mux import write_mp4

    request = Request(index=0, prompt="p", seed=1, width=32, height=32, frames=22)
    frames = np.random.default_rng(0).integers(0, 256, (22, 32, 32, 3), dtype=np.uint8)
    path = tmp_path / resume.clip_name(request, "tiny")
    write_mp4(path, frames, np.sin(np.arange(29334) / 9)[None].repeat(2, 0) * 0.5,
              comment=fingerprint.stamp(fingerprint.clip_fields({}, request)))
    whole = path.read_bytes()

    def manifest(sha256):
        record = {"path": str(path), "status": "ok", "sha256": sha256}
        (tmp_path / "manifest.jsonl").write_text(json.dumps(record) + "\n")

    demuxed = []
    monkeypatch.setattr("h3gen.run.validate.validate_clip",
                        lambda *a, **k: demuxed.append(a[0]) or validate_clip(*a, **k))
    manifest(hashlib.sha256(whole).hexdigest())
    assert resume.already_done(request, tmp_path, "tiny", False, {}).status == "skipped" and demuxed == []
    path.write_bytes(whole[:-9] + bytes([whole[-9] ^ 1]) + whole[-8:])
    found = resume.already_done(request, tmp_path, "tiny", False, {})
    assert found.status == "damaged" and "not those h3gen wrote" in found.error and demuxed == [], found.error
    path.write_bytes(whole)
    manifest(None)
    assert resume.already_done(request, tmp_path, "tiny", False, {}).status == "skipped" and demuxed == [path]


def test_a_clip_whose_stamp_is_no_longer_text_is_one_conflict(tmp_path):
    """Bytes flipped inside the metadata: PyAV cannot even open the file (it decodes every tag as UTF-8). Its stamp
    unreadable, it is a whole MP4 h3gen cannot show it wrote: a conflict that says why, left alone, never an error
    that stops the run or `h3gen validate`."""
    import numpy as np

    from h3gen.inputs.request import Request
    from h3gen.run.resume import already_done, clip_name
    from h3gen.run.validate import validate_clip
    from h3gen.stages.mux import write_mp4

    request = Request(index=0, prompt="p", seed=1, width=32, height=32, frames=22)
    frames = np.random.default_rng(0).integers(0, 256, (22, 32, 32, 3), dtype=np.uint8)
    path, stamp = tmp_path / clip_name(request, "tiny"), fingerprint.stamp(fingerprint.clip_fields({}, request))
    write_mp4(path, frames, np.sin(np.arange(29334) / 9)[None].repeat(2, 0) * 0.5, comment=stamp)
    data = path.read_bytes()
    at = data.index(stamp.encode()) + len(stamp) // 2
    path.write_bytes(data[:at] + b"\xff\x8c\xff\x8c" + data[at + 4:])
    assert validate_clip(path) == ["its metadata is not UTF-8 text (damaged)"]
    found = already_done(request, tmp_path, "tiny", False, {})
    assert found.status == "conflict" and "metadata is not UTF-8 text (damaged)" in found.error, found.error


def test_a_line_removed_above_default_seeded_prompts_is_named_before_they_render_anew(prompts_file, tmp_path):
    """Their clips are there under the seeds their old places gave; a prompt repeated on the next line (its clip is
    this file's own) and a line with an id or its own seed are not counted."""
    from h3gen.inputs.prompts import read_prompts as read
    from h3gen.run.resume import clip_name, moved_seeds

    def read_prompts(path, seed, defaults):
        return read(path, seed, {"duration": 5, "width": 32, "height": 32})

    out = tmp_path / "out"
    out.mkdir()
    before = read_prompts(prompts_file("gone\na fox\na fox\nrain\n"), 0, {})
    for request in before:
        (out / clip_name(request, "tiny")).write_bytes(b"clip")
    after = read_prompts(prompts_file("# gone\na fox\na fox\nrain\n"), 0, {})
    pending = [r for r in after if not (out / clip_name(r, "tiny")).exists()]
    assert [r.prompt for r in pending] == ["a fox", "rain"]  # the first fox takes the second's old seed and name
    note = moved_seeds(pending, after, out, "tiny", 0)
    assert note.startswith(f"2 of the clips to render have a clip in {out} from the same prompt under a seed 1 higher: "
                           "a prompt line above them was removed or commented out")
    assert moved_seeds(pending, after, out, "tiny", 7) == ""  # seeds of their own, not the defaults
    inserted = read_prompts(prompts_file("new\ngone\na fox\na fox\nrain\n"), 0, {})
    pending = [r for r in inserted if not (out / clip_name(r, "tiny")).exists()]
    assert "under a seed 1 lower: a prompt line above them was added" in moved_seeds(pending, inserted, out, "tiny", 0)
    swapped = read_prompts(prompts_file("a fox\ngone\na fox\nrain\n"), 0, {})  # a fox one up, gone one down
    pending = [r for r in swapped if not (out / clip_name(r, "tiny")).exists()]
    assert moved_seeds(pending, swapped, out, "tiny", 0).startswith(
        "2 of the clips to render have a clip in {} from the same prompt under a seed a few places away: prompt lines "
        "were moved, added or removed (or --seed changed), which moved their default seeds".format(out))
    # Rendered again over their own names (--force, --redo-conflicts, damaged): nothing moved.
    assert moved_seeds(list(after), after, out, "tiny", 0) == note  # the two new ones alone
    assert moved_seeds([r for r in after if (out / clip_name(r, "tiny")).exists()], after, out, "tiny", 0) == ""

    far_out = tmp_path / "far"  # five lines gone above: seeds five places away
    far_out.mkdir()
    five_gone = read_prompts(prompts_file("".join(f"# gone {i}\n" for i in range(5)) + "a fox\nrain\n"), 0, {})
    for request in five_gone:
        (far_out / clip_name(dataclasses.replace(request, seed=request.seed + 5), "tiny")).write_bytes(b"clip")
    far = moved_seeds(five_gone, five_gone, far_out, "tiny", 0)
    assert far.startswith(f"2 of the clips to render have a clip in {far_out} from the same prompt under a seed 5 higher: "
                          "5 prompt lines above them were removed or commented out"), far

    planned = h3gen("render", prompts_file("# gone\na fox\na fox\nrain\n"), "-o", out, "--dry-run", "-q")
    assert "h3gen: note: 2 of the clips to render have a clip in" in planned.stderr, planned.stderr


def test_a_clip_changed_inside_a_frame_fails_validate_and_a_rerun_renders_it_again(prompts_file, tmp_path):
    """MP4 has no checksum, and a byte changed inside a frame decodes without an error: the manifest's sha256 of the
    clip as h3gen wrote it is what tells. `h3gen validate` says so, and a rerun renders the clip again."""
    import av

    from h3gen.run.validate import validate_clip

    out, prompts = tmp_path / "out", prompts_file('{"id": "a", "prompt": "a fox"}\n')
    h3gen("render", prompts, "-o", out, check_code=0)
    clip, whole = out / "a.mp4", (out / "a.mp4").read_bytes()
    assert json.loads((out / "manifest.jsonl").read_text())["sha256"] == __import__("hashlib").sha256(whole).hexdigest()
    with av.open(str(clip)) as container:
        frames = [(p.pos, p.size) for p in container.demux(container.streams.video[0]) if p.size]
    for pos, size in frames[1:]:  # the first byte whose change the decoder does not notice
        changed = bytearray(whole)
        changed[pos + size // 2] ^= 0x01
        clip.write_bytes(changed)
        if validate_clip(clip) == []:
            break
    else:
        pytest.fail("every changed frame failed to decode")
    checked = h3gen("validate", clip, check_code=1)
    assert checked.stderr == (f"{clip}: INVALID: its bytes are not those h3gen wrote (the sha256 in manifest.jsonl "
                              "beside it): damaged or changed since; the h3gen render that wrote it renders it "
                              "again when run once more\n"), checked.stderr
    planned = h3gen("render", prompts, "-o", out, "--dry-run", check_code=0)
    assert planned.stdout.strip().endswith("a.mp4: there but damaged: its bytes are not those h3gen wrote (the sha256 "
                                           "in manifest.jsonl beside it): damaged or changed since; rendered again")
    redone = h3gen("render", prompts, "-o", out, "-q", check_code=0)  # news even to --quiet: a file changed
    (line,) = redone.stderr.splitlines()  # timestamped, as every line in a log is
    assert line.endswith(f" note: {clip} is there but damaged: its bytes are not those h3gen wrote (the sha256 in "
                         "manifest.jsonl beside it): damaged or changed since; rendered again"), redone.stderr
    assert clip.read_bytes() == whole
    assert h3gen("validate", clip, check_code=0).stdout == f"{clip}: ok\n"


def test_the_embedding_cache_is_keyed_by_the_quant_stages_knobs(prompts_file, tmp_path):
    """Which roles the quant stage quantizes changes the text encoder's output: another roles list misses the cache."""
    prompts, cache = prompts_file("a fox\n"), tmp_path / "cache"
    args = ["--set", f"encode.cache_dir={cache}", "--set", "quant.use=fp8-rowwise"]
    h3gen("render", prompts, "-o", tmp_path / "a", *args, check_code=0)
    again = h3gen("render", prompts, "-o", tmp_path / "b", *args, check_code=0)
    assert "(1 from the embedding cache)" in again.stderr
    other = h3gen("render", prompts, "-o", tmp_path / "c", *args, "--set", 'quant.roles=["dit"]', check_code=0)
    assert "(0 from the embedding cache)" in other.stderr, other.stderr


def test_a_knob_a_stage_gained_since_a_clip_was_stamped_is_no_difference_at_its_default(tiny_model):
    """A clip stamped before its mux had `crf` is this run's while crf stays at its default; set otherwise, or with
    the stage at another version, it differs."""
    from h3gen.config.preset import resolve
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import registry

    def fields(*overrides):
        return fingerprint.run_fields(resolve("tiny", registry(), list(overrides)), registry(), ModelRepo(tiny_model))

    new = fields()
    before_crf = {key: value for key, value in new.items() if key != "mux.crf"}
    assert fingerprint.differences(before_crf, new) == []
    assert fingerprint.differences(before_crf, fields("mux.crf=30")) == ["mux.crf: (none) -> 30"]
    other_version = before_crf | {"mux.use": "pyav h3gen/0"}
    assert fingerprint.differences(other_version, new) == [f"mux.use: pyav h3gen/0 -> {new['mux.use']}",
                                                           f"mux.crf: (none) -> {new['mux.crf']}"]
    assert fingerprint.differences(new | {"mux.crf": None}, new) == [f"mux.crf: (none) -> {new['mux.crf']}"]


def test_a_rerun_says_its_header_before_the_lines_of_the_clips_already_there(prompts_file, tmp_path):
    out = tmp_path / "out"
    h3gen("render", prompts_file("a lighthouse at night\n"), "-o", out, check_code=0)
    again = h3gen("render", prompts_file("a lighthouse at night\nrain on a tin roof\n"), "-o", out, check_code=0)
    said = again.stderr.index
    assert said("h3gen: 1 clip(s) to render, preset tiny") < said("[1/2] skipped ") < said("[2/2] wrote ")


def test_a_keyframe_taken_off_a_line_is_a_difference_as_one_put_on_it_is():
    old = {"request.prompt": "fox", "request.first_frame": "aa11"}
    assert fingerprint.differences(old, {"request.prompt": "fox", "request.last_frame": "aa11"}) == [
        "request.first_frame: aa11 -> (none)", "request.last_frame: (none) -> aa11"]
