"""Errors a user can act on. Each renders as one line: what is wrong, then how to fix it."""


def one_line(text: str) -> str:
    """`text` with every line break written as an escape, so a name read from the user cannot split the message."""
    return "".join(repr(c)[1:-1] if c in LINE_BREAKS else c for c in text)


LINE_BREAKS = frozenset("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")  # where str.splitlines cuts
HOST_MEMORY_FIX = ("leave h3gen more: close other programs or raise `ulimit -v`; or render fewer frames or a smaller "
                   "size")


def debugging() -> bool:
    """--traceback (or H3GEN_DEBUG=1): a failure prints where it came from, its traceback, above its one line."""
    import os

    return os.environ.get("H3GEN_DEBUG", "") not in ("", "0")


def where_it_came_from() -> str:
    """How a failure's line sends the user to where it came from: the traceback above it, or --traceback."""
    return "the traceback above says where" if debugging() else "rerun with --traceback for where"


def host_memory_ran_out(error: BaseException) -> bool:
    """Whether `error` is the host's memory (or an address-space limit) running out where Python or a library asked
    for more: an allocation, a thread's stack, a shared library's mapping."""
    import errno

    text = str(error).lower()
    return (isinstance(error, MemoryError) or getattr(error, "errno", None) == errno.ENOMEM
            or any(said in text for said in ("can't start new thread", "cannot allocate memory",
                                             "failed to map segment", "can't allocate memory")))


class H3genError(Exception):
    """A problem with the user's input or environment; the CLI prints it as one line (and each of `also` as one)
    and exits non-zero."""

    exit_code = 2
    also: tuple["H3genError", ...] = ()  # more problems of the same input, found in the same pass (`together`)

    def __init__(self, problem: str, fix: str = ""):
        self.problem, self.fix = one_line(problem), one_line(fix)
        super().__init__(f"{self.problem}{' (' + self.fix + ')' if self.fix else ''}")


def together(errors: list[H3genError]) -> H3genError:
    """The first of several problems found in one pass (a prompts file's bad lines), the others as its `also`: the
    CLI prints each as a line of its own, so one run names them all."""
    errors[0].also = tuple(errors[1:])
    return errors[0]


class UsageError(H3genError):
    exit_code = 2


class ModelError(H3genError):
    exit_code = 2


class WriteError(H3genError):
    """A write the run cannot do without (a full disk, a read-only folder): the run stops cleanly; a rerun resumes."""

    exit_code = 1


class ClipError(H3genError):
    """One clip failed; the run goes on with the others."""

    exit_code = 1
