"""h3gen: batch renderer for MiniMax-H3."""

__version__ = "0.1.0"
