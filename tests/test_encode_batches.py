"""A chunk's prompts of one token count go through the text encoder in one forward (`encode.batch_tokens`): each
prompt's rows are what its own forward through diffusers' call gives."""

import pytest
import torch

from conftest import h3gen, media

# Three prompts of four tokens each, one of two.
EQUAL = ["a red fox runs", "the red fox runs", "a fox red runs"]
SHORTER = "a fox"


def encoder(tiny_model, *overrides, device="cpu", dtype=torch.float32):
    from h3gen.config.preset import resolve
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import registry
    from h3gen.run.render import Runtime
    from h3gen.run.timing import StageTimer

    found, repo = registry(), ModelRepo(tiny_model)
    preset = resolve("tiny", found, ["encode.cache=false", *overrides])
    runtime = Runtime(device, dtype, StageTimer(device))
    name, config = preset.stages["quant"]
    runtime.quant = found.stage("quant", name)(config, runtime)
    runtime.quant.load(repo)
    encode = found.stage("encode", "qwen3vl")(preset.stages["encode"][1], runtime)
    encode.load(repo)
    return encode


def clips(prompts):
    from h3gen.inputs.request import Request
    from h3gen.stages.clip import Clip

    return [Clip(request=Request(index=i, prompt=p, seed=0, width=32, height=32, frames=124, id=f"c{i}"), path=None,
                 preset="tiny") for i, p in enumerate(prompts)]


def forwards_counted(encode, monkeypatch) -> list:
    """The row count of every forward the encoder's language model runs from here on."""
    if encode.text_encoder is None:
        encode.load_encoder()
    model, seen = encode.text_encoder.model, []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda input_ids, **kw: seen.append(len(input_ids)) or forward(input_ids,
                                                                                                           **kw))
    return seen


def encoded(encode, prompts) -> list:
    chunk = clips(prompts)
    encode.prepare_chunk(chunk)
    return [encode.run(clip).prompt_embeds for clip in chunk]


def test_the_prompts_fixture_has_the_token_counts_the_tests_rely_on(tiny_model):
    encode = encoder(tiny_model)
    assert [len(encode.prompt_tokens(p)) for p in EQUAL] == [4, 4, 4]
    assert len(encode.prompt_tokens(SHORTER)) == 2


def test_prompts_of_one_token_count_are_encoded_in_one_forward_as_each_alone_gives_them(tiny_model, monkeypatch):
    # fp32 on the CPU: each prompt's rows equal its own forward through diffusers' call to 1e-5 (the same bits here).
    alone = encoded(encoder(tiny_model, "encode.batch_tokens=0"), [*EQUAL, SHORTER])
    encode = encoder(tiny_model)
    seen = forwards_counted(encode, monkeypatch)
    together = encoded(encode, [*EQUAL, SHORTER])
    assert seen == [3, 1]  # the three of four tokens in one forward, the shorter prompt in its own
    for mine, reference in zip(together, alone):
        assert mine.shape == reference.shape == (1, mine.shape[1], reference.shape[2])
        torch.testing.assert_close(mine, reference, rtol=0, atol=1e-5)
    assert encode.ready == {}  # every clip took its rows: nothing of the chunk is held


def test_batch_tokens_caps_a_forward_s_rows_and_a_repeated_prompt_is_one_row(tiny_model, monkeypatch):
    encode = encoder(tiny_model, "encode.batch_tokens=8")  # two prompts of four tokens a forward
    seen = forwards_counted(encode, monkeypatch)
    out = encoded(encode, [EQUAL[0], EQUAL[1], EQUAL[0], EQUAL[2]])
    assert seen == [2, 1]
    assert torch.equal(out[0], out[2])
    assert encoder(tiny_model, "encode.batch_tokens=0").groups(clips(EQUAL)) == []


def test_cached_and_over_long_prompts_stay_out_of_the_forward(tiny_model, tmp_path, monkeypatch):
    from h3gen.errors import ClipError

    encode = encoder(tiny_model, "encode.cache=true", f"encode.cache_dir={tmp_path}", "encode.max_tokens=4")
    encoded(encode, [EQUAL[0]])  # now in the cache
    chunk = clips([EQUAL[0], EQUAL[1], EQUAL[2], SHORTER + " " + EQUAL[0]])  # the last is 6 tokens, over 4
    seen = forwards_counted(encode, monkeypatch)
    assert [clip.request.index for clip in encode.prepare_chunk(chunk)] == [1, 2]
    assert encode.run(chunk[0]).encode_cached
    encode.run(chunk[1]), encode.run(chunk[2])
    with pytest.raises(ClipError, match="over the encoder limit"):
        encode.run(chunk[3])
    assert seen == [2]


def test_a_group_whose_forward_fails_encodes_each_prompt_alone(tiny_model, monkeypatch):
    alone = encoded(encoder(tiny_model, "encode.batch_tokens=0"), EQUAL)
    encode = encoder(tiny_model)

    def out_of_memory(rows):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(encode, "hidden_states", out_of_memory)
    seen = forwards_counted(encode, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(encoded(encode, EQUAL), alone))
    assert seen == [1, 1, 1]


def test_a_render_of_prompts_encoded_together_writes_the_clips_each_alone_gives(prompts_file, tmp_path):
    prompts = prompts_file("\n".join(EQUAL[:2]) + "\n")
    for name, value in (("together", 1024), ("alone", 0)):
        h3gen("render", prompts, "-o", tmp_path / name, "--set", "encode.cache=false", "--set",
              f"encode.batch_tokens={value}", check_code=0)
    together, alone = (sorted((tmp_path / name).glob("*.mp4")) for name in ("together", "alone"))
    assert len(together) == 2 and [media(p) for p in together] == [media(p) for p in alone]


@pytest.mark.cuda
def test_on_a_gpu_prompts_encoded_together_match_each_alone(tiny_model):
    # bf16 on the device: another row count may pick other GEMM kernels; within one bf16 step of each value's size.
    alone = encoded(encoder(tiny_model, "encode.batch_tokens=0", device="cuda", dtype=torch.bfloat16), EQUAL)
    together = encoded(encoder(tiny_model, device="cuda", dtype=torch.bfloat16), EQUAL)
    for mine, reference in zip(together, alone):
        torch.testing.assert_close(mine.float(), reference.float(), rtol=2 ** -7, atol=1e-3)
