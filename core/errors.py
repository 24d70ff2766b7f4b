"""Errors a user can act on. Each renders as one line: what is wrong, then how to fix it."""


class H3genError(Exception):
    """A problem with the user's input or environment; the CLI prints it as one line and exits non-zero."""

    exit_code = 2

    def __init__(self, problem: str, fix: str = ""):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}{' (' + fix + ')' if fix else ''}")


class UsageError(H3genError):
    exit_code = 2


class ModelError(H3genError):
    exit_code = 2


class ClipError(H3genError):
    """One clip failed; the run goes on with the others."""

    exit_code = 1
