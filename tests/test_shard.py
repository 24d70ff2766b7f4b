"""`--shard I/N`: a deterministic split of one prompts file between independent runs."""

import pytest

from conftest import h3gen
from h3gen.errors import UsageError
from h3gen.inputs.prompts import parse_shard, read_prompts, shard_requests

DEFAULTS = {"width": 32, "height": 32, "duration": 5.0}


def test_shard_syntax():
    assert parse_shard("0/1") == (0, 1) and parse_shard("3/4") == (3, 4)
    for bad in ("4/4", "-1/4", "1/0", "1", "a/b", "1/2/3", ""):
        with pytest.raises(UsageError):
            parse_shard(bad)


def test_shards_are_round_robin_disjoint_and_cover_the_file(prompts_file):
    path = prompts_file("# header\n" + "".join(f"prompt {i}\n\n" for i in range(10)))
    requests = read_prompts(path, 0, DEFAULTS)
    shards = [shard_requests(requests, (i, 3)) for i in range(3)]
    assert [[r.index for r in shard] for shard in shards] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    # Requests keep their place in the file, so seeds (and file names) are those of an unsharded run.
    assert [r.seed for r in shards[1]] == [1, 4, 7]
    assert shard_requests(requests, None) == requests
    # Appending prompts moves no existing one to another shard.
    longer = read_prompts(prompts_file(path.read_text() + "prompt 10\nprompt 11\n"), 0, DEFAULTS)
    assert [r.index for r in shard_requests(longer, (1, 3))][:3] == [r.index for r in shards[1]]


def test_bad_shard_is_a_usage_error(prompts_file, tmp_path):
    result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", "--shard", "2/2", check_code=2)
    assert "shard 2 of 2 does not exist" in result.stderr and "0/2 to 1/2" in result.stderr
    assert not (tmp_path / "out").exists()


def test_one_process_run_renders_its_shard_only(prompts_file, tmp_path):
    prompts = prompts_file("a red fox\nwaves on rocks\na lighthouse at night\n")
    out = tmp_path / "out"
    result = h3gen("render", prompts, "-o", out, "--shard", "1/2", "--json", check_code=0)
    (record,) = [line for line in result.stdout.splitlines()]
    assert '"line": 2' in record and '"seed": 1' in record
    assert "[2/3]" in result.stderr and "1 of 1 clips written" in result.stderr
    # The one clip is named as the unsharded run names it.
    from h3gen.run.resume import clip_name

    (request,) = shard_requests(read_prompts(prompts, 0, DEFAULTS), (1, 2))
    assert [p.name for p in out.glob("*.mp4")] == [clip_name(request, "tiny")]


@pytest.mark.parametrize("dry", [[], ["--dry-run"], ["--cpu-workers", "2"]])
def test_an_empty_shard_says_so_and_leaves_no_directory(prompts_file, tmp_path, dry):
    prompts, out = prompts_file("a red fox\nwaves on rocks\na lighthouse at night\n"), tmp_path / "out"
    result = h3gen("render", prompts, "-o", out, "--shard", "4/5", *dry, check_code=0)
    assert (f"h3gen: shard 4/5 holds none of the 3 prompt(s) of {prompts} (prompt k of the file, from 0, goes to "
            "shard k mod 5): nothing to do") in result.stderr
    assert not out.exists()


def test_the_one_shard_of_one_is_named_alone():
    from h3gen.errors import UsageError
    from h3gen.inputs.prompts import parse_shard

    with pytest.raises(UsageError) as refused:
        parse_shard("1/1")
    assert refused.value.fix == "I counts from 0: pass 0/1"
