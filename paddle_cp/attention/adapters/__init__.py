"""Adapters that route a model's attention calls to paddle_cp (see attention/dispatch/routing.py): Paddle's SDPA here, a
model library's own attention functions registered by its integration (`register_adapter`)."""
from ... import runtime
from . import sdpa


def register_adapter(name, install, uninstall):
    """Route a model library's attention functions too: `install()` (idempotent) wraps them while a
    context-parallel layer lives, `uninstall()` puts them back."""
    if not (callable(install) and callable(uninstall)):
        raise TypeError(f"register_adapter({name!r}, install, uninstall) takes two callables")
    runtime.installed.attention_adapters.setdefault(name, (install, uninstall))


def install(holder):
    """Intercept F.scaled_dot_product_attention and every registered library's attention functions while
    `holder` (a layer a context-parallel plan was applied to) lives: undone once the last one is released."""
    runtime.installed.hold_patch("sdpa", holder, sdpa.install, sdpa.uninstall)
    for name, (install_adapter, uninstall_adapter) in list(runtime.installed.attention_adapters.items()):
        runtime.installed.hold_patch(name, holder, install_adapter, uninstall_adapter)
