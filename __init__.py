"""h3gen: batch renderer for MiniMax-H3."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

_CHECKOUT = _os.path.realpath(_os.path.dirname(__file__))


def _without_checkout(path: list[str]) -> list[str]:
    """`path` without the checkout's root. The root is this package's own folder, and `python -m` run in the checkout
    (pytest, the torchrun workers of a render started there) puts it first on sys.path, where its folders would
    shadow installed packages of the same names: kernels/ would hide Hugging Face's `kernels`, which transformers
    imports. h3gen's modules are always imported as `h3gen.*`, never from there."""
    return [entry for entry in path if _os.path.realpath(entry or _os.curdir) != _CHECKOUT]


_sys.path[:] = _without_checkout(_sys.path)
