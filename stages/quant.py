"""Quantization: a load-time transform of the modules other stages load."""

from h3gen.stages.base import Stage


class NoQuant(Stage):
    kind, name = "quant", "none"
    description = "keep the checkpoint's precision"

    def transform(self, role: str, module):
        """Called by the stage that loaded `module` (`role`: 'dit' or 'text_encoder'); returns what runs."""
        return module

    def run(self, clip):
        return clip
