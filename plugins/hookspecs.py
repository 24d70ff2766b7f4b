"""The hooks h3gen calls, in the order a run calls them. Built-in stages register through them too."""

import pluggy

hookspec = pluggy.HookspecMarker("h3gen")
hookimpl = pluggy.HookimplMarker("h3gen")


@hookspec
def h3gen_register_stages(register):
    """At start-up: call `register(stage_class)` for each `Stage` subclass the plugin provides.

    The class's `kind` and `name` are how presets refer to it (`[sampler] use = "name"`).
    """


@hookspec
def h3gen_register_presets(register):
    """At start-up: call `register(path)` for each preset TOML file the plugin ships."""
