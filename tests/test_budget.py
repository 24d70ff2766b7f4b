"""The memory plan: from a budget, the architecture's sizes and the largest clip's activations, how many DiT blocks
stream from host memory; the released model's sizes as measured on an H200 (diffusers' full-size classes)."""

import pytest

from h3gen.errors import UsageError
from h3gen.models.dit.checkpoint import H3DiTConfig
from h3gen.run.budget import GIB, DiTSizes, plan_memory


def test_a_full_size_block_is_the_385_m_parameters_shared_h3_md_counts():
    sizes = DiTSizes.of(H3DiTConfig(), weight_bytes=2, table_rows=50)
    assert abs(sizes.block_bytes / 2 / 1e6 - 385) < 2
    fp8 = DiTSizes.of(H3DiTConfig(), weight_bytes=1, table_rows=50)
    assert abs(fp8.block_bytes / 1e9 - 0.39) < 0.01


def test_the_plan_streams_the_fewest_blocks_that_fit():
    sizes = DiTSizes.of(H3DiTConfig(), weight_bytes=1, table_rows=50)
    roomy = plan_memory(140 * GIB, sizes, 10 * GIB)
    assert roomy.streamed == 0 and "every DiT block resident" in roomy.describe()
    tight = plan_memory(24 * GIB, sizes, 10 * GIB)
    assert 0 < tight.streamed < sizes.blocks and tight.peak_bytes <= 24 * GIB
    assert plan_memory(24 * GIB, sizes, 10 * GIB - sizes.block_bytes).streamed == tight.streamed - 1
    assert tight.host_bytes == tight.streamed * sizes.block_bytes
    assert f"{sizes.blocks - tight.streamed} of {sizes.blocks} DiT blocks resident" in tight.describe()


def test_the_plan_streams_at_least_what_the_preset_asks_and_says_so():
    sizes = DiTSizes.of(H3DiTConfig(), weight_bytes=1, table_rows=50)
    every = plan_memory(140 * GIB, sizes, 10 * GIB, streamed_at_least=sizes.blocks)
    assert every.streamed == sizes.blocks and every.host_bytes == sizes.blocks * sizes.block_bytes
    assert f"0 of {sizes.blocks} DiT blocks resident" in every.describe()
    tight = plan_memory(24 * GIB, sizes, 10 * GIB)
    assert plan_memory(24 * GIB, sizes, 10 * GIB, streamed_at_least=1).streamed == tight.streamed  # more it needs


def test_a_budget_no_plan_meets_names_the_smallest_that_would():
    sizes = DiTSizes.of(H3DiTConfig(), weight_bytes=1, table_rows=50)
    with pytest.raises(UsageError, match=r"no plan fits the DiT in a device memory budget of 4 GiB \(--vram, runtime.vram_gib\).*give --vram \d+ or more"):
        plan_memory(4 * GIB, sizes, 10 * GIB)
    with pytest.raises(UsageError, match=r"no plan fits the DiT in the 4.0 GiB free on the GPU"):
        plan_memory(4 * GIB, sizes, 10 * GIB, asked=False)
    with pytest.raises(UsageError, match=r"or more on a GPU that has it, an FP8 preset, or a shorter"):
        plan_memory(4 * GIB, sizes, 10 * GIB)
    with pytest.raises(UsageError, match=r"or more on a GPU that has it, or a shorter"):  # FP8 already
        plan_memory(4 * GIB, sizes, 10 * GIB, fp8=True)


def test_the_decoders_weights_count_against_the_budget():
    sizes = DiTSizes.of(H3DiTConfig(), weight_bytes=1, table_rows=50)
    alone = plan_memory(24 * GIB, sizes, 8 * GIB)
    beside = plan_memory(24 * GIB, sizes, 8 * GIB, other_bytes=5 * GIB)
    assert beside.streamed > alone.streamed and beside.peak_bytes <= 24 * GIB
    found = plan_memory(140 * GIB, sizes, 8 * GIB, asked=False)
    assert "140.0 GiB (free on the GPU)" in found.describe() and found.record()["asked"] is False


def test_a_budget_on_a_cpu_run_is_refused_before_any_weight_loads(prompts_file, tmp_path):
    from conftest import h3gen

    # The budget is said as either source may have given it: --vram, or runtime.vram_gib of the preset or a --set.
    for budget in (["--vram", "8"], ["--set", "runtime.vram_gib=8"]):
        result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", *budget, check_code=2)
        assert result.stderr.splitlines()[-1] == (
            "h3gen: error: a device memory budget of 8 GiB (--vram, runtime.vram_gib) is for a GPU, and this run is on "
            "the CPU (run on a GPU, or give --vram 0 for none; a preset's runtime.vram_gib gives one too)")
    assert not (tmp_path / "out").exists()  # nor the output directory the refused run would have made
    (tmp_path / "kept").mkdir()
    h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "kept", "--vram", "8", check_code=2)
    assert (tmp_path / "kept").is_dir()  # one that was there stays


def test_the_text_encoder_streams_when_it_does_not_fit_beside_the_resident_dit():
    from types import SimpleNamespace

    from h3gen.run.budget import follow

    sizes = DiTSizes.of(H3DiTConfig(), weight_bytes=1, table_rows=100)
    roomy = plan_memory(140 * GIB, sizes, 6 * GIB, 5 * GIB, encoder_bytes=25 * GIB)
    tight = plan_memory(24 * GIB, sizes, 6 * GIB, 5 * GIB, encoder_bytes=25 * GIB)
    assert not roomy.stream_encoder and tight.stream_encoder and tight.streamed
    assert "the text encoder streamed layer by layer" in tight.describe() and tight.record()["stream_encoder"]
    sampler, encode = SimpleNamespace(stream_blocks=0), SimpleNamespace(stream_layers=False)
    follow(SimpleNamespace(stages={"sampler": ("euler", sampler), "encode": ("qwen3vl", encode)}), tight)
    assert sampler.stream_blocks == tight.streamed and encode.stream_layers


def test_bench_refuses_a_budget_on_the_cpu_before_measuring(tmp_path):
    from conftest import h3gen

    result = h3gen("bench", "--preset", "tiny", "--baseline", "none", "--vram", "8", "--random-weights", "tiny",
                   "-o", tmp_path, check_code=2)
    assert result.stderr.splitlines()[-1].startswith(
        "h3gen: error: a device memory budget of 8 GiB (--vram, runtime.vram_gib) is for a GPU, and this run is on the CPU")
    assert not list(tmp_path.iterdir())


def test_the_cap_and_the_free_memory_name_the_current_gpu_when_the_run_says_cuda(monkeypatch):
    # torch's set_per_process_memory_fraction takes a device index only; a preset's device may be plain "cuda".
    from types import SimpleNamespace

    import torch

    from h3gen.run import budget, memory

    calls = {}

    def indexed(name, value):
        def call(*args):
            device = args[-1]
            assert isinstance(device, int), f"{name} got {device!r}"
            calls[name] = args
            return value
        return call

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", indexed("properties", SimpleNamespace(total_memory=80 * GIB)))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", indexed("fraction", None))
    monkeypatch.setattr(torch.cuda, "mem_get_info", indexed("info", (60 * GIB, 80 * GIB)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", indexed("allocated", 4 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", indexed("reserved", 6 * GIB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", indexed("cap", 0.5))
    budget.hold_to("cuda", 20)
    assert calls["fraction"] == (0.25, 3)
    budget.hold_to("cuda:1", 0)
    assert calls["fraction"] == (1.0, 1)
    # within the cap: 0.5 of 80 GiB less the 4 allocated, though the device has 60 free and 2 cached
    assert memory.free_bytes("cuda") == 36 * GIB


def test_the_feed_forward_passes_over_row_chunks_only_where_streaming_every_block_is_not_enough(monkeypatch):
    """bf16 h3-base at the full-size 10 s clip: 24 GiB streams blocks with the feed-forward whole; 16 GiB does not
    fit even with every block streamed, so its plan also runs the feed-forward in 16k-row passes."""
    from h3gen.bench.random_weights import FullSizeRandom
    from h3gen.inputs.request import frames_for_duration
    from h3gen.config.preset import resolve
    from h3gen.inputs.request import Request
    from h3gen.models.repo import ModelRepo
    from h3gen.models.tiny import ensure_tiny_model
    from h3gen.plugins.manager import registry
    from h3gen.run import budget, memory

    monkeypatch.setattr(budget, "check_budget", lambda gib, device: None)  # no GPU here to hold the budget to
    monkeypatch.setattr(budget, "host_available_bytes", lambda: 2**50)  # nor the host memory a full-size run needs
    monkeypatch.setattr(memory, "free_on_device", lambda device: 80 * GIB)
    repo = FullSizeRandom(ModelRepo(ensure_tiny_model()))
    request = Request(index=0, prompt="a", seed=0, width=1344, height=768, frames=frames_for_duration(10), id="b")
    plans = {}
    for gib in (24, 16, 12):
        preset = resolve("h3-base", registry(), [f"runtime.vram_gib={gib}"])
        try:
            plans[gib] = budget.planned(preset, [request], repo, "cuda")
        except UsageError as error:
            plans[gib] = str(error)
        if gib == 16:
            assert preset.stages["sampler"][1].ffn_chunk_rows == budget.FFN_CHUNK_ROWS  # the sampler follows
    assert plans[24].ffn_chunk_rows == 0 and plans[24].streamed < 50
    assert plans[16].ffn_chunk_rows == budget.FFN_CHUNK_ROWS and plans[16].streamed > plans[24].streamed
    assert "16384-row passes" in plans[16].describe() and plans[16].record()["ffn_chunk_rows"] == 16384
    assert "give --vram 16 or more" in plans[12]  # what the chunked run needs (18 unchunked), the least any plan needs


def full_size_plan(monkeypatch, preset_name: str, gib: int, host_gib: float, free_gib: float = 80):
    """`budget.planned` for the full-size 10 s clip at `gib` GiB, on an 80 GiB GPU with `free_gib` free, with
    `host_gib` free in host memory: the plan, or the UsageError's line and fix."""
    from h3gen.bench.random_weights import FullSizeRandom
    from h3gen.inputs.request import frames_for_duration
    from h3gen.config.preset import resolve
    from h3gen.inputs.request import Request
    from h3gen.models.repo import ModelRepo
    from h3gen.models.tiny import ensure_tiny_model
    from h3gen.plugins.manager import registry
    from h3gen.run import budget, memory

    monkeypatch.setattr(budget, "device_bytes", lambda device: 80 * GIB)
    monkeypatch.setattr(memory, "free_on_device", lambda device: int(free_gib * GIB))
    monkeypatch.setattr(budget, "host_available_bytes", lambda: int(host_gib * GIB))
    repo = FullSizeRandom(ModelRepo(ensure_tiny_model()))
    request = Request(index=0, prompt="a", seed=0, width=1344, height=768, frames=frames_for_duration(10), id="b")
    preset = resolve(preset_name, registry(), [f"runtime.vram_gib={gib}"])
    try:
        return budget.planned(preset, [request], repo, "cuda")
    except UsageError as error:
        return f"{error} | {error.fix}"


def test_too_little_host_memory_names_the_budget_whose_plan_fits_it(monkeypatch):
    """h3-base-fp8 at 24 GiB holds its streamed blocks and the text encoder in host memory; with less free than
    that, the smallest larger budget that holds little enough is named, before any weight loads."""
    fits = full_size_plan(monkeypatch, "h3-base-fp8", 24, host_gib=128)
    assert fits.host_bytes > 40 * GIB
    refused = full_size_plan(monkeypatch, "h3-base-fp8", 24, host_gib=fits.host_bytes / GIB - 1)
    assert "and this machine has" in refused and "GiB of host memory free" in refused
    larger = int(refused.split("give --vram ")[1].split(" ")[0])
    host_gib = fits.host_bytes / GIB - 1
    assert larger > 24 and not isinstance(full_size_plan(monkeypatch, "h3-base-fp8", larger, host_gib), str)
    assert isinstance(full_size_plan(monkeypatch, "h3-base-fp8", larger - 1, host_gib), str)  # the smallest


def test_with_no_budget_the_gpu_has_fitting_the_host_memory_the_fix_is_memory_or_fp8(monkeypatch):
    refused = full_size_plan(monkeypatch, "h3-base", 16, host_gib=2)
    assert "free" in refused.split(" | ")[1] and "an FP8 preset" in refused.split(" | ")[1]
    assert "an FP8 preset" not in full_size_plan(monkeypatch, "h3-base-fp8", 16, host_gib=2).split(" | ")[1]


@pytest.mark.parametrize("reported_gib,accepted,refused", [(23.99, 24, 27), (22.49, 24, 25), (16.0, 16, 18)])
def test_a_card_s_size_as_sold_is_a_budget_it_takes(monkeypatch, reported_gib, accepted, refused):
    """An RTX 4090 reports 23.99 GiB, a 24 GB L4 22.5 with ECC on: --vram 24 is taken on either; a budget well
    beyond the card is refused, naming a whole number of GiB the card has."""
    from h3gen.run import budget

    monkeypatch.setattr(budget, "device_bytes", lambda device: int(reported_gib * GIB))
    budget.check_budget(accepted, "cuda")
    with pytest.raises(UsageError, match=rf"a device memory budget of {refused:g} GiB \(--vram, runtime.vram_gib\) "
                                         rf"is more than the GPU's {reported_gib:.1f} GiB") as error:
        budget.check_budget(refused, "cuda")
    assert f"give at most {int(reported_gib)}," in error.value.fix and "or no budget" in error.value.fix


def test_a_budget_above_what_the_gpu_has_free_plans_for_what_is_free(monkeypatch):
    plan = full_size_plan(monkeypatch, "h3-base-fp8", 24, host_gib=128, free_gib=22.5)
    assert plan.budget_bytes == int(22.5 * GIB) and plan.peak_bytes <= 22.5 * GIB
    assert "memory plan for 22.5 GiB (24 GiB asked: what is free on the GPU)" in plan.describe()
    assert plan.record()["asked_gib"] == 24 and plan.record()["vram_gib"] == 22.5 and not plan.record()["asked"]
    refused = full_size_plan(monkeypatch, "h3-base", 16, host_gib=128, free_gib=12)  # no plan fits what is free
    assert refused.startswith("no plan fits the DiT in the 12.0 GiB free on the GPU")
    assert "asked" not in full_size_plan(monkeypatch, "h3-base-fp8", 24, host_gib=128).describe()


def test_vram_takes_a_number_of_gib_with_or_without_its_unit(prompts_file, tmp_path):
    from conftest import h3gen
    from h3gen.cli.main import vram_setting

    assert [vram_setting(text) for text in ("24", "24G", "24gb", " 16GiB ", "0", ".5")] == [
        ["runtime.vram_gib=24"], ["runtime.vram_gib=24"], ["runtime.vram_gib=24"], ["runtime.vram_gib=16"],
        ["runtime.vram_gib=0"], ["runtime.vram_gib=0.5"]]
    assert vram_setting(None) == []
    for text in ("abc", "nan", "-3", "24 MB", "1e400"):
        result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", "--vram", text, check_code=2)
        what = "below 0" if text == "-3" else "not a number of GiB"
        assert result.stderr.splitlines()[-1] == (f"h3gen: error: --vram {text} is {what} (give one "
                                                  "like 24, 24G or 24GB, or 0 for what is free)")
    for text, said in (("", "--vram is empty"), ("-0", "--vram -0 is not a number of GiB"),
                       ("-2.5G", "--vram -2.5G is below 0")):
        with pytest.raises(UsageError, match=f"^{said} \\(give one like 24"):
            vram_setting(text)
    assert not (tmp_path / "out").exists()
