"""What a ``--vericache`` server's SGLang ``ServerArgs`` record carries, and the names VeriCache
is registered under there.

The plugin (``srt/plugin.py``) writes the record: the config under ``SERVER_ARGS_ATTR``, the
VERICACHE algorithm and the ``vericache`` attention backend and prefix cache in SGLang's own
fields. The worker, the prefix cache and the hooks read it back. They import these names from
here, not from the plugin or the registration, which import them in turn: this module imports
nothing of ``srt/``, so reading the record closes no import circle.
"""

from __future__ import annotations

from typing import Any

from sglang_vericache.config import VeriCacheConfig

ALGORITHM = "VERICACHE"  # --speculative-algorithm
BACKEND_NAME = "vericache"  # --attention-backend and --radix-cache-backend
AUTO_DRAFT_LEN = 16  # most drafts per verify with --vericache-draft-len auto (verify/draft_length.py)

SERVER_ARGS_ATTR = "_vericache"  # the config, as a dict; underscore attributes survive pickling
# whether the same server without --vericache would overlap its scheduling (srt/hooks/penalties.py)
PLAIN_OVERLAP_ATTR = "_vericache_plain_overlap"


def vericache_config(server_args: Any) -> VeriCacheConfig:
    """The config carried by a ServerArgs record (disabled if it has none)."""
    raw = getattr(server_args, SERVER_ARGS_ATTR, None)
    return VeriCacheConfig() if raw is None else VeriCacheConfig.from_dict(raw)
