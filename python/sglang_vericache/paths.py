"""Where this package keeps files between runs: one root, one rule for overriding each place.

    $<ENV of the place>            if set (a test, or an operator who wants it elsewhere)
    $XDG_CACHE_HOME/sglang_vericache/<name>   else, with ~/.cache when XDG_CACHE_HOME is unset
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_path(name: str, env: str) -> Path:
    """The place ``name`` under the package's cache root, unless ``$env`` names another."""
    explicit = os.environ.get(env)
    if explicit:
        return Path(explicit).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "sglang_vericache" / name
