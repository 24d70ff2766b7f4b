"""The attention backends a preset may name, without loading torch: the command checks a preset before it starts
workers, and the workers load the kernels (h3gen.kernels.attention)."""

# The FP8 ones (the last three) trade accuracy for speed, so "auto" never picks them: a preset or --set asks by name.
BACKENDS = ("fa3", "flash-attn-4", "sdpa-cudnn", "sdpa-flash", "sdpa", "triton-fp8", "cudnn-fp8", "fa3-fp8")


def check_backend_name(key: str, name: str) -> None:
    """A preset's attention value (`key` names it): UsageError unless it is "auto" or one of BACKENDS."""
    if name not in ("auto", *BACKENDS):
        from h3gen.errors import UsageError

        raise UsageError(f"unknown {key} '{name}'", f"choose auto or one of {', '.join(BACKENDS)}")
