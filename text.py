"""Text as h3gen shows it: whatever a prompt, a file name or an error holds, on one line and harmless."""

from __future__ import annotations


def shown(text: str) -> str:
    """`text` on one line: what is not printable (newlines, escape sequences, NUL, line separators) written as Python
    escapes, so a prompt can neither forge a line nor drive the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
