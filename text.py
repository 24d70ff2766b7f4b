"""Text as h3gen shows it: whatever a prompt, a file name or an error holds, on one line and harmless."""

from __future__ import annotations


def shown(text: str) -> str:
    """`text` on one line: what is not printable (newlines, escape sequences, NUL, line separators) written as Python
    escapes, so a prompt can neither forge a line nor drive the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def abridged(text: str, most: int = 300) -> str:
    """`text` up to `most` characters, and how long it was when it is longer: a prompt in a log line."""
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"
