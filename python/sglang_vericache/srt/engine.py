"""VeriCache for the offline ``sglang.Engine``: ServerArgs built with the same rules as the CLI.

``sgl.Engine(**kwargs)`` builds its ``ServerArgs`` before SGLang has loaded plugins and rejects
unknown keyword arguments, so ``vericache=True`` cannot go there directly. Build the record
here and hand it over::

    import sglang as sgl
    from sglang_vericache.srt.engine import vericache_server_args

    engine = sgl.Engine(server_args=vericache_server_args(vericache_compressor="snapkv:ratio=0.25"))
    engine.generate("Hello", {"temperature": 0, "max_new_tokens": 16})

Keyword arguments are ``ServerArgs`` fields plus ``vericache`` (default True here),
``vericache_compressor``, ``vericache_draft_len``, ``vericache_tier`` and
``vericache_fetch_drafting``, with the CLI's
validation and messages; ``model_path`` defaults to the embedded model.
"""

from __future__ import annotations

import re
from typing import Any

from sglang_vericache.config import VeriCacheConfigError, parse_cli_flags

_VERICACHE_KWARGS = ("vericache_compressor", "vericache_draft_len", "vericache_tier",
                     "vericache_fetch_drafting")


def vericache_server_args(**kwargs: Any) -> Any:
    """A ``sglang.srt.server_args.ServerArgs`` with VeriCache applied (see module doc).

    Raises ``VeriCacheConfigError`` (a ValueError naming the argument) on a bad value or a
    conflicting SGLang argument, before any model loads.
    """
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from sglang_vericache.srt import plugin

    load_plugins()
    plugin.register()  # also when the entry points are not on SGLANG_PLUGINS
    flags = ["--vericache"] if kwargs.pop("vericache", True) else []
    for key in _VERICACHE_KWARGS:
        if key in kwargs:
            flags += ["--" + key.replace("_", "-"), str(kwargs.pop(key))]
    given = ["--" + key.replace("_", "-") for key in kwargs]
    try:
        config = parse_cli_flags(flags)
        plugin.check_compatible(config, given)
    except VeriCacheConfigError as exc:  # name the keywords, not the CLI flags
        raise VeriCacheConfigError(_as_kwarg(exc.flag), _as_kwarg(exc.reason)) from None
    if "model_path" not in kwargs:
        from sglang_vericache.models import ensure_default_model

        kwargs["model_path"] = str(ensure_default_model())
    kwargs.setdefault("log_level", "error")
    server_args = ServerArgs(**kwargs)
    plugin.attach(server_args, config)
    return server_args


def _as_kwarg(text: str) -> str:
    """'--vericache-draft-len' -> 'vericache_draft_len' wherever a CLI flag is named."""
    return re.sub(r"--([a-z][a-z0-9-]*)", lambda m: m.group(1).replace("-", "_"), text)
