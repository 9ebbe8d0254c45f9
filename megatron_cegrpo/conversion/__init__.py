"""Checkpoint conversion plugins behind ``tools/checkpoint/convert.py`` (see its README).

``loader_<name>`` modules read a source (``hf``, ``gguf``, ``megatron``) into a
:class:`~megatron_cegrpo.conversion.plugin_common.ModelPayload`; ``saver_<name>`` modules
(``megatron``, ``hf``) write one. :func:`plugin` returns one of them by kind and name.
"""

import importlib

LOADERS = ("hf", "gguf", "megatron")
SAVERS = ("megatron", "hf")

__all__ = ["LOADERS", "SAVERS", "plugin"]


def plugin(kind: str, name: str):
    """The ``loader_<name>`` (kind ``"loader"``) or ``saver_<name>`` (kind ``"saver"``) module."""
    return importlib.import_module(f"megatron_cegrpo.conversion.{kind}_{name}")
