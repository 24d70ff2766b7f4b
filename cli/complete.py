"""Shell completion of what only h3gen knows: preset names, `--set` keys and the registered stage names."""

from __future__ import annotations


def preset_names(incomplete: str) -> list[str]:
    from h3gen.plugins.manager import registry

    return [name for name in sorted(registry().presets) if name.startswith(incomplete)]


def set_keys(ctx, incomplete: str) -> list[str]:
    """`section.key=` for every key of the preset on the command line (tiny when none is given yet); after
    `KIND.use=`, the registered stages of that kind."""
    from h3gen.config.preset import describe, resolve
    from h3gen.plugins.manager import registry

    found = registry()
    key, equals, _ = incomplete.partition("=")
    if equals and key.endswith(".use"):
        kind = key[: -len(".use")]
        return [f"{key}={name}" for k, name in sorted(found.stages) if k == kind and
                f"{key}={name}".startswith(incomplete)]
    try:
        params = ctx.params or {}
        preset = resolve(params.get("preset") or params.get("name") or "tiny", found)
    except Exception:  # a half-typed preset: complete the keys every preset has
        preset = resolve("tiny", found)
    keys = [f"{key}=" for key, _, _ in describe(preset) if key != "version"]
    return [key for key in keys if key.startswith(incomplete)]
