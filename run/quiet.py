"""Keep library chatter (weight-loading bars, deprecation notices) out of the user's terminal."""

import logging
import warnings


def quiet_libraries() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.nn.utils.weight_norm")
    warnings.filterwarnings("ignore", message=".*torch_dtype.*")
    # torch's CPU RMSNorm over bf16 activations with the checkpoint's fp32 norm weights: it takes its unfused path,
    # with the same values; nothing for the user to act on.
    warnings.filterwarnings("ignore", category=UserWarning, message="Mismatch dtype between input and weight")
    # torch.compile's C++ build on a machine with a CUDA toolkit and no GPU names the toolkit it found, once a process.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        library.set_verbosity_error()
        library.disable_progress_bar()
