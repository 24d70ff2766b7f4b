"""`python -m h3gen.cli.worker JOB`: one torchrun worker (h3gen.parallel.worker), drawing with the command's own
reporters (`reporter_for`, which the launcher draws its own lines with too), since global rank 0 reports the run as
a one-process run would."""

import sys

from h3gen.cli.ui import reporter_for, results_only_on_stdout
from h3gen.parallel.worker import main

if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    with results_only_on_stdout():  # a stage's own prints go to stderr
        code = record(main)(sys.argv[1:], reporter_for)
    from h3gen.run.memory import exit_soon

    exit_soon()
    sys.exit(code)
