"""Checkpoint conversion plugins behind ``tools/checkpoint/convert.py`` (see its README).

``loader_<name>`` modules read a source (``hf``, ``gguf``, ``megatron``) into a
:class:`~megatron_cegrpo.conversion.plugin_common.ModelPayload`; ``saver_<name>`` modules
(``megatron``, ``hf``) write one. :func:`plugin` returns one of them by kind and name.
"""

import importlib

LOADERS = ("hf", "gguf", "megatron")
SAVERS = ("megatron", "hf")

__all__ = ["LOADERS", "SAVERS", "plugin"]


# the functions each kind of plugin module defines (plugin_common's protocol)
PLUGIN_FUNCTIONS = {"loader": ("add_arguments", "load_checkpoint"),
                    "saver": ("add_arguments", "preflight", "save_checkpoint")}


def plugin(kind: str, name: str):
    """The ``loader_<name>`` (kind ``"loader"``) or ``saver_<name>`` (kind ``"saver"``) module.

    Raises TypeError when the module lacks one of ``PLUGIN_FUNCTIONS[kind]``."""
    module = importlib.import_module(f"megatron_cegrpo.conversion.{kind}_{name}")
    missing = [f for f in PLUGIN_FUNCTIONS[kind] if not callable(vars(module).get(f))]
    if missing:
        raise TypeError(f"--{kind} {name}: conversion plugin {module.__name__} lacks {', '.join(missing)}; "
                        f"fix: define them (see megatron_cegrpo/conversion/plugin_common.py)")
    return module
