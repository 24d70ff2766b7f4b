"""Keep library chatter (weight-loading bars, deprecation notices) out of the user's terminal."""

import warnings


def quiet_libraries() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.nn.utils.weight_norm")
    warnings.filterwarnings("ignore", message=".*torch_dtype.*")
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for logging in (diffusers_logging, transformers_logging):
        logging.set_verbosity_error()
        logging.disable_progress_bar()
