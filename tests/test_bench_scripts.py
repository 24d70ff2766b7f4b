"""The GPU check scripts in bench/ in their CPU dry runs (--tiny), so a change to the stages cannot break them unseen.
Their numbers are the tiny model's; what is checked is that every phase runs and that the fast paths still agree
with diffusers where they are exact."""
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_script(name, *args, out):
    result = subprocess.run([sys.executable, str(BENCH / name), *args], capture_output=True, text=True,
                            env={**os.environ, "OUT": str(out)}, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "DONE" in result.stdout or name == "vae_gpu_check.py", result.stdout[-2000:]
    return result


def test_dit_gpu_check_dry_run(tmp_path):
    run_script("dit_gpu_check.py", "kernels,ref,fast", "--tiny", out=tmp_path)
    results = json.loads((tmp_path / "dit_gpu_check.json").read_text())
    for name in ("fused", "fused+triton+table"):
        assert results[name]["rel_err_vs_diffusers"] < 1e-6, (name, results[name])
    assert results["fp8+table+sdpa"]["rel_err_vs_diffusers"] < 1e-2


def test_dit_numerics_dry_run(tmp_path):
    run_script("dit_numerics.py", "--tiny", "--gemm", out=tmp_path)
    results = json.loads((tmp_path / "dit_numerics.json").read_text())
    assert results["diffusers_ops_reproduce_block"]["differing"] == 0
    assert all(row["differing"] == 0 for name, row in results["ops_torch_rows"].items() if "block" not in name)
    assert results["ops_torch_table"]["x2"]["differing"] == 0  # the table group built for the forward


def test_vae_gpu_check_dry_run(tmp_path):
    out = tmp_path / "vae.json"
    run_script("vae_gpu_check.py", "-o", str(out), "--tiny", "--only=exact,fast-auto", "--profile=fast-auto",
               out=tmp_path)
    variants = json.loads(out.read_text())["variants"]
    assert variants["exact"]["uint8_max_abs"] == 0
    assert variants["fast-auto"]["uint8_max_abs"] <= 2 and "profile_s" in variants["fast-auto"]


def test_vae_numerics_dry_run(tmp_path):
    run_script("vae_numerics.py", "--tiny", out=tmp_path)
    results = json.loads((tmp_path / "vae_numerics.json").read_text())
    assert results["diffusers_ops_reproduce_block"]["differing"] == 0
    # The CPU runs the kernels' torch references, which round as diffusers' ops do.
    for name in ("qkv (fused GEMM)", "q (qk_norm_rope exact norms)", "hidden1 (residual_rmsnorm)", "swiglu",
                 "hidden2 (residual add)"):
        assert results[name]["differing"] == 0, (name, results[name])


def test_encode_probe_dry_run(tmp_path):
    """Two prompts alone and together on the tiny model: the batched forward gives each prompt's own bits."""
    out = tmp_path / "encode.json"
    result = subprocess.run([sys.executable, str(BENCH / "encode_probe.py"), "--preset", "tiny", "--tiny",
                             "--prompts", "2", "--repeat", "1", "-o", str(out)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["prompts"] == 2 and len(report["one_prompt"]["walls"]) == 2
    assert report["together"]["same_bits"] and report["together"]["max_abs_vs_one_prompt"] == [0.0, 0.0]
