"""The batch path: prompts encoded first (with an embedding cache), background muxing, shared output directories."""

import json
import subprocess
import sys

import pytest

from conftest import h3gen
from h3gen.run.report import SilentReporter
from h3gen.run.validate import validate_clip

THREE = '{"id": "a", "prompt": "a fox"}\n{"id": "b", "prompt": "waves"}\n{"id": "c", "prompt": "rain on a roof"}\n'


@pytest.mark.parametrize("vae", ["reference", "fast"])
def test_background_muxing_writes_the_same_bytes_as_muxing_in_line(prompts_file, tmp_path, vae):
    """With the fast VAE the background mux starts with the decode and reads the frames as they land."""
    prompts = prompts_file(THREE)
    for workers in (0, 2):
        h3gen("render", prompts, "-o", tmp_path / f"w{workers}", "--set", f"mux.workers={workers}",
              "--set", f"vae.use={vae}", check_code=0)
    for name in "abc":
        assert (tmp_path / f"w0/{name}.mp4").read_bytes() == (tmp_path / f"w2/{name}.mp4").read_bytes()


def test_a_second_run_takes_its_embeddings_from_the_cache(prompts_file, tmp_path):
    prompts = prompts_file(THREE)
    cache = ["--set", f'encode.cache_dir="{tmp_path / "cache"}"']  # an empty cache of this test's own
    first = h3gen("render", prompts, "-o", tmp_path / "first", *cache, check_code=0)
    assert "encoded 3 prompt(s)" in first.stderr and "(0 from the embedding cache)" in first.stderr
    second = h3gen("render", prompts, "-o", tmp_path / "second", "--json", *cache, check_code=0)
    assert "(3 from the embedding cache)" in second.stderr
    for name in "abc":
        assert (tmp_path / f"first/{name}.mp4").read_bytes() == (tmp_path / f"second/{name}.mp4").read_bytes()
    # Another encode setting is another key: nothing comes from the cache.
    third = h3gen("render", prompts, "-o", tmp_path / "third", "--set", "encode.layer=49", *cache, check_code=0)
    assert "(0 from the embedding cache)" in third.stderr


def test_the_encoder_weights_never_load_on_a_full_cache_hit(tiny_model, tmp_path):
    import torch

    from h3gen.inputs.request import Request
    from h3gen.stages.clip import Clip
    from h3gen.run.embedding_cache import EmbeddingCache
    from h3gen.run.render import Runtime
    from h3gen.models.repo import ModelRepo
    from h3gen.stages.encode import Qwen3VLConfig, Qwen3VLEncoder
    from h3gen.stages.quant import NoQuant
    from h3gen.run.timing import StageTimer

    runtime = Runtime("cpu", torch.float32, StageTimer("cpu"))
    runtime.quant = NoQuant(None, runtime)
    encoder = Qwen3VLEncoder(Qwen3VLConfig(), runtime)
    encoder.load(ModelRepo(tiny_model))
    encoder.cache = EmbeddingCache("weights", {}, tmp_path)
    embeds, tags = torch.randn(1, 3, 32), torch.ones(3, dtype=torch.long)
    encoder.cache.put("cached prompt", embeds, tags)
    clip = encoder(Clip(Request(0, "cached prompt", 0, 32, 32, 124), tmp_path / "x.mp4"))
    assert encoder.text_encoder is None
    assert torch.equal(clip.prompt_embeds, embeds) and torch.equal(clip.text_token_tags, tags)


def test_the_cache_past_its_size_loses_its_least_recently_used_entries(tmp_path):
    import os

    import torch

    from h3gen.run.embedding_cache import EmbeddingCache

    def put(cache, prompt):
        cache.put(prompt, torch.full((1, 64, 32), float(len(prompt))), torch.ones(64, dtype=torch.long))

    unlimited = EmbeddingCache("weights", {}, tmp_path)
    for n in range(5):
        put(unlimited, f"prompt {n}")
    entry = unlimited.path("prompt 0").stat().st_size
    for n in range(5):  # older and older, from prompt 0's use a minute ago back
        os.utime(unlimited.path(f"prompt {n}"), (0, 1_000_000 - 60 * n))
    assert unlimited.get("prompt 3") is not None  # a hit is a use: prompt 3 is now the newest
    cache = EmbeddingCache("weights", {}, tmp_path, max_bytes=6 * entry)  # another run, held to 6 entries
    put(cache, "prompt 5")
    assert cache.get("prompt 4") is not None  # 6 entries: nothing removed, and prompt 4 used now
    put(cache, "prompt 6")  # 7 > 6: down to 90% of 6, the least recently used first
    kept = sorted(path.name for path in tmp_path.glob("??/*.safetensors"))
    assert kept == sorted(cache.path(f"prompt {n}").name for n in (0, 3, 4, 5, 6)), kept  # 1 and 2 were oldest
    assert cache.get("prompt 1") is None and cache.get("prompt 2") is None
    put(unlimited, "prompt 7")  # no limit: nothing removed
    assert len(list(tmp_path.glob("??/*.safetensors"))) == 6


def test_overlapping_runs_on_one_directory_never_write_the_same_clip(prompts_file, tmp_path):
    prompts, out = prompts_file(THREE), tmp_path / "out"
    runs = [subprocess.Popen([sys.executable, "-m", "h3gen.cli.main", "render", str(prompts), "-o", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for run in runs:
        _, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr[-2000:]
    events = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    for name in "abc":
        statuses = sorted(e["status"] for e in events if e["path"] == str(out / f"{name}.mp4"))
        assert statuses.count("ok") == 1, (name, statuses)  # written once; the other run skipped it
        assert len(statuses) == 2 and set(statuses) <= {"ok", "busy", "skipped"}
        assert validate_clip(out / f"{name}.mp4", expected_frames=124) == []
    assert not list(out.glob(".*"))  # no claims or partial files left behind


class EventLog(SilentReporter):
    """A reporter that keeps what the run said and when each clip started, in order."""

    def __init__(self):
        self.events = []

    def say(self, text):
        self.events.append(("say", text))

    def clip_started(self, clip):
        self.events.append(("started", clip.request.index))


def test_a_long_batch_starts_rendering_after_its_first_chunk_of_prompts(tiny_model, tmp_path, monkeypatch):
    """Prompts are encoded a chunk at a time (small first, then doubling), each chunk's clips rendered before the
    next is encoded, with a line per chunk: 10,000 prompts no longer wait for the last one's encoding. On the CPU
    the encoder stays loaded."""
    from h3gen.run.render import chunk_sizes

    assert chunk_sizes(10_000)[:5] == [8, 16, 32, 64, 64] and sum(chunk_sizes(10_000)) == 10_000
    assert chunk_sizes(3) == [3] and chunk_sizes(30) == [8, 16, 6]
    from h3gen.config.preset import resolve
    from h3gen.inputs.prompts import read_prompts
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import registry
    from h3gen.run import render

    monkeypatch.setattr(render, "FIRST_ENCODE_CHUNK", 1)
    monkeypatch.setattr(render, "ENCODE_CHUNK", 2)
    preset = resolve("tiny", registry(), ["encode.cache=false"])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(5)))
    log = EventLog()
    renderer = render.Renderer(preset, registry(), ModelRepo(tiny_model), log)
    encode = renderer.stages["encode"]
    real_run = encode.run

    def logged_run(clip):
        log.events.append(("encoding", clip.request.index))
        return real_run(clip)

    monkeypatch.setattr(encode, "run", logged_run)
    results = list(renderer.render(read_prompts(prompts, 0, preset.request), tmp_path / "out"))
    renderer.close()
    assert [r.ok for r in results] == [True] * 5
    order = [event for event in log.events if event[0] in ("encoding", "started")]
    assert order == [("encoding", 0), ("started", 0), ("encoding", 1), ("encoding", 2), ("started", 1),
                     ("started", 2), ("encoding", 3), ("encoding", 4), ("started", 3), ("started", 4)]
    said = [text for kind, text in log.events if kind == "say"]
    assert [line.split(" in ")[0] for line in said if "encoded" in line] == [
        "h3gen: encoded 1 prompt(s) (1-1 of 5)", "h3gen: encoded 2 prompt(s) (2-3 of 5)",
        "h3gen: encoded 2 prompt(s) (4-5 of 5)"]
    assert encode.encoder_loads == 1


class StepLog(EventLog):
    """An EventLog that hears of each forward and of each finished clip; at a clip's first forward it waits for the
    clip before it to be muxed, as a long forward on a GPU would."""

    def __init__(self, renderer_of):
        super().__init__()
        self.renderer_of = renderer_of

    def step(self, clip, step, steps):
        muxing = self.renderer_of().muxing
        if step == 1 and muxing:
            muxing[0][2].result(timeout=60)
        self.events.append(("step", clip.request.index, step))

    def clip_done(self, result):
        self.events.append(("done", result.request.index))


def test_a_clip_is_finished_as_its_background_mux_ends_not_after_the_next_clip(tiny_model, tmp_path):
    """Its manifest line and --json record come at the next clip's first forward after its mux, not once the
    next clip is through."""
    from h3gen.config.preset import resolve
    from h3gen.inputs.prompts import read_prompts
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import registry
    from h3gen.run import render

    preset = resolve("tiny", registry(), ["encode.cache=false", "sampler.steps=4"])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a fox\nwaves\n")
    holder = []
    log = StepLog(lambda: holder[0])
    holder.append(render.Renderer(preset, registry(), ModelRepo(tiny_model), log))
    results = list(holder[0].render(read_prompts(prompts, 0, preset.request), tmp_path / "out"))
    holder[0].close()
    assert [r.ok for r in results] == [True, True]
    order = [event for event in log.events if event[0] in ("step", "done")]
    assert order.index(("done", 0)) == order.index(("step", 1, 1)) + 1, order
    assert order[-1] == ("done", 1)
