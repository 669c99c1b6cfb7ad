"""The SGLang plugin (entry point group ``sglang.srt.plugins``): flags, defaults, validation.

SGLang calls ``register()`` in every one of its processes (launcher, scheduler, detokenizer,
...), so it must be idempotent and cheap. It only registers hooks; the hooks do the work:

- ``ServerArgs.add_cli_args`` (AFTER): adds the "VeriCache" flag group, so the flags parse and
  show in ``--help``.
- ``prepare_server_args`` (AROUND): re-reads the ``--vericache*`` flags from argv, validates them
  before anything loads (a bad value exits with status 2 and a message naming the flag), and
  attaches the config to the ServerArgs record as ``_vericache``; underscore attributes survive
  pickling into SGLang's subprocesses. With no ``--model-path`` it serves the embedded default
  model (fetched and converted once; see ``sglang_vericache.models``).
- resolution step ``handle_missing_default_values``: on our CPU platform, default ``--device``
  to ``cpu`` (SGLang would otherwise ask the platform for a ``torch.device`` and choke on it).
- KV pool sizing on the CPU platform (``platform.register_pool_sizing_hook``): from total host
  RAM, so several servers can start on one host at once.
- request validation (``sglang_vericache.srt.hooks.validation``): requests that would crash the
  scheduler get HTTP 400 in the tokenizer process instead, with or without ``--vericache``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from sglang_vericache.config import (
    VeriCacheConfig,
    VeriCacheConfigError,
    add_cli_flags,
    parse_cli_flags,
)
from sglang_vericache.server_record import (
    ALGORITHM,
    AUTO_DRAFT_LEN,
    BACKEND_NAME,
    PLAIN_OVERLAP_ATTR,
    SERVER_ARGS_ATTR,
)

logger = logging.getLogger(__name__)

_HOOK_SOURCE = "sglang_vericache"

# SGLang loads plugins once per process, but Engine users and tests may call register() again;
# hooks and resolution steps must not be stacked twice.
_registered = False


def _add_cli_args(result: Any, parser: argparse.ArgumentParser, *args: Any, **kw: Any) -> Any:
    add_cli_flags(parser)
    return result


# Flags that --vericache sets itself; a user value would silently fight it.
_OWNED_FLAGS = {
    "--speculative-algorithm": "--vericache selects its own speculative algorithm",
    "--speculative-num-draft-tokens": "use --vericache-draft-len",
    "--attention-backend": "--vericache selects its own attention backend",
    "--enable-mixed-chunk": "mixed prefill/decode batches would decode without verification",
    "--radix-cache-backend": "--vericache selects its own prefix cache, which knows rows whose "
    "full KV is in host memory",
    "--enable-hierarchical-cache": "the full KV already lives in host memory (--vericache-tier)",
}


def check_compatible(config: VeriCacheConfig, argv: list[str]) -> None:
    if not config.enabled:
        return
    given = {a.split("=", 1)[0] for a in argv}
    for flag, why in _OWNED_FLAGS.items():
        if flag in given:
            raise VeriCacheConfigError("--vericache", f"cannot be combined with {flag} ({why})")


def _apply(server_args: Any, config: VeriCacheConfig) -> None:
    """Point SGLang at the VERICACHE worker and attention backend (record not yet resolved)."""
    # the same server without --vericache would overlap its scheduling unless told not to;
    # penalties follow that scheduler's rule (srt/hooks/penalties.py)
    setattr(server_args, PLAIN_OVERLAP_ATTR, not server_args.disable_overlap_schedule)
    drafts = AUTO_DRAFT_LEN if config.draft_len is None else config.draft_len
    server_args.speculative_algorithm = ALGORITHM
    # verify width: last token + drafts (the offload-only baseline, 0 drafts, keeps width 2)
    server_args.speculative_num_draft_tokens = max(drafts, 1) + 1
    server_args.attention_backend = BACKEND_NAME
    server_args.radix_cache_backend = BACKEND_NAME  # knows rows offloaded to host memory
    server_args.disable_overlap_schedule = True  # the worker runs synchronously


def _prepare_server_args(original: Callable[..., Any], argv: list[str], *a: Any, **kw: Any) -> Any:
    argv = list(argv)
    if "-h" not in argv and "--help" not in argv:
        try:
            config = parse_cli_flags(argv)
            check_compatible(config, argv)
        except VeriCacheConfigError as exc:
            prog = "sglang serve" if "sglang" in sys.argv[0] else "sglang.launch_server"
            argparse.ArgumentParser(prog=prog).error(str(exc))  # exits with status 2
        argv = _with_default_model(argv)
    else:
        config = VeriCacheConfig()
    server_args = original(argv, *a, **kw)
    attach(server_args, config)
    return server_args


def attach(server_args: Any, config: VeriCacheConfig) -> None:
    """Carry ``config`` on ``server_args`` to every SGLang process; with it enabled, select the
    VERICACHE worker, attention backend and prefix cache."""
    setattr(server_args, SERVER_ARGS_ATTR, config.to_dict())
    if config.enabled:
        _apply(server_args, config)


def _has_model_path(argv: list[str]) -> bool:
    flags = ("--model-path", "--model")
    return any(a in flags or a.split("=", 1)[0] in flags for a in argv) or "--config" in argv


def _with_default_model(argv: list[str]) -> list[str]:
    """``argv`` with ``--model-path`` pointing at the embedded default model when none is given."""
    if _has_model_path(argv):
        return argv
    from sglang_vericache.models import DEFAULT_MODEL_NAME, ensure_default_model

    path = str(ensure_default_model())
    logger.warning("no --model-path given: serving the embedded %s (%s)", DEFAULT_MODEL_NAME, path)
    return ["--model-path", path, *argv]


def _cpu_device_default(server_args: Any, previous: Callable[[Any], None]) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.platforms import current_platform

    from sglang_vericache.srt.platform import TorchCpuPlatform

    if resolving_view(server_args).device is None and isinstance(
        current_platform, TorchCpuPlatform
    ):
        declare_resolution(server_args, "vericache:cpu_platform", device="cpu")
    previous(server_args)


def register() -> None:
    """Entry point: register the hooks once per process."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_vericache.srt.kv.admission import register_admission_hook
    from sglang_vericache.srt.hooks.grammar_finish import register_grammar_finish_hooks
    from sglang_vericache.srt.hooks.idle import register_idle_hook
    from sglang_vericache.srt.prefix.model_identity import register_weight_version_hooks
    from sglang_vericache.srt.hooks.patches import register_patches
    from sglang_vericache.srt.hooks.penalties import register_penalty_hook
    from sglang_vericache.srt.platform import register_pool_sizing_hook
    from sglang_vericache.srt.registration import (
        register_algorithm,
        register_backend,
        register_radix_cache,
    )
    from sglang_vericache.srt.hooks.validation import register_validation_hooks

    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.add_cli_args", _add_cli_args, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.server_args.prepare_server_args", _prepare_server_args, HookType.AROUND
    )
    register_resolution_hook("handle_missing_default_values")(_cpu_device_default)
    register_backend()
    register_algorithm()
    register_radix_cache()
    register_patches()
    register_admission_hook()
    register_idle_hook()
    register_penalty_hook()
    register_grammar_finish_hooks()
    register_validation_hooks()
    register_pool_sizing_hook()
    register_weight_version_hooks()
    _registered = True
