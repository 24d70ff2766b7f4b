import functools
import logging


def test_torch_s_note_on_a_cuda_toolkit_without_a_gpu_stays_out_of_the_log(monkeypatch, request, tmp_path, capfd):
    """torch.compile's C++ build on a CPU machine with a CUDA toolkit installed logs the toolkit it found ("No CUDA
    runtime is found, using CUDA_HOME=..."): a run with `-q` that went well prints nothing, so h3gen keeps it out."""
    import torch
    import torch.utils.cpp_extension as cpp_extension

    from h3gen.run.quiet import quiet_libraries

    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    logger = logging.getLogger("torch.utils.cpp_extension")
    request.addfinalizer(functools.partial(logger.setLevel, logger.level))
    logger.setLevel(logging.NOTSET)  # as torch leaves it, whatever an earlier test in this process did
    assert cpp_extension._find_cuda_home() == str(tmp_path)
    assert "No CUDA runtime is found" in capfd.readouterr().err  # what torch says, left alone
    quiet_libraries()
    assert cpp_extension._find_cuda_home() == str(tmp_path)
    assert capfd.readouterr().err == ""
