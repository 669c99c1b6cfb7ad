"""The model identity this SGLang process puts into its tier keys, and its weight version.

``tier/identity.py`` computes an identity from plain values; this module reads them from the
server: the model path (a local directory, or the local snapshot of a hub id), the resolved
weight dtype and quantization, the arguments that change the model's numbers, the TP rank,
and a weight version counted by this process.

Weight version: SGLang 0.5.23 changes a running server's weights through
``SchedulerWeightUpdaterManager.update_weights_from_{disk,tensor,distributed,ipc}`` and, for
loads that bypass those (P2P/RDMA), ``end_weight_update``; ``resume_memory_occupation`` may
bring weights back from elsewhere. An AFTER hook on each bumps the counter whether or not the
call reports success, because a failed update can leave weights partly replaced: a needless
bump costs tier misses, a missing one would serve another model's KV. The hooks are
registered with SGLang's HookRegistry (applied by SGLang after plugins load), like every other
hook of this package.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.identity import ModelIdentity, canonical_json

logger = logging.getLogger(__name__)

WEIGHT_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater." \
    "SchedulerWeightUpdaterManager"
WEIGHT_CHANGING_METHODS = (
    "update_weights_from_disk", "update_weights_from_tensor",
    "update_weights_from_distributed", "update_weights_from_ipc", "end_weight_update",
    "resume_memory_occupation",
)
# ServerArgs fields that change the model's numbers beyond weights, config and dtype. Unset
# values (None, "", "auto", "{}", SGLang's "default" weight version) are left out, so two
# servers started alike hash alike.
OVERRIDE_ARGS = (
    "json_model_override_args", "revision", "load_format", "model_impl",
    "model_loader_extra_config", "quantization_param_path", "modelopt_quant",
    "rl_quant_profile", "custom_weight_loader", "weight_version",
)

_lock = threading.Lock()
_weight_version = 0


def weight_version() -> int:
    """Weight changes this process has seen since it started (0: the weights it loaded)."""
    return _weight_version


def bump_weight_version(reason: str) -> int:
    global _weight_version
    with _lock:
        _weight_version += 1
        version = _weight_version
    logger.info("model weights changed (%s): tier keys now use weight version %d", reason,
                version)
    return version


def _after_weight_change(method: str) -> Callable[..., Any]:
    def hook(result: Any, *args: Any, **kwargs: Any) -> Any:
        bump_weight_version(method)
        return result

    hook.__name__ = f"vericache_after_{method}"
    return hook


def register_weight_version_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for method in WEIGHT_CHANGING_METHODS:
        HookRegistry.register(f"{WEIGHT_UPDATER}.{method}", _after_weight_change(method),
                              HookType.AFTER)


def model_overrides(server_args: Any) -> dict[str, Any]:
    """The set OVERRIDE_ARGS of ``server_args`` (JSON strings parsed, so spacing and key
    order do not matter)."""
    out: dict[str, Any] = {}
    for name in OVERRIDE_ARGS:
        value = getattr(server_args, name, None)
        if isinstance(value, str) and value.lstrip().startswith(("{", "[")):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        if _is_unset(value):
            continue
        out[name] = value if isinstance(value, (str, int, float, bool, list, dict)) \
            else repr(value)
    return out


def _is_unset(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return value in ("", "auto", "default")
    return isinstance(value, (list, tuple, dict)) and len(value) == 0


def local_model_path(model_path: str, revision: str | None) -> Path | None:
    """The directory (or GGUF file) SGLang loaded ``model_path`` from, or None if unknown.

    By the time the prefix cache is built the scheduler has loaded the model, so a hub id
    resolves to its local snapshot without network access."""
    path = Path(model_path).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_path, revision=revision, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 (not a hub id, not cached, no huggingface_hub)
        logger.debug("no local snapshot of %s: %s", model_path, exc)
        return None


def server_model_identity(server_args: Any, model_config: Any, tp_rank: int) -> ModelIdentity:
    """This server's identity at weight version 0 (``with_weight_version`` moves it on)."""
    dtype = str(getattr(model_config, "dtype", server_args.dtype)).removeprefix("torch.")
    quantization = getattr(model_config, "quantization", None) or server_args.quantization
    overrides = model_overrides(server_args)
    model_path = str(server_args.model_path)
    local = None if server_args.load_format == "dummy" \
        else local_model_path(model_path, server_args.revision)
    if local is not None:
        try:
            return ModelIdentity.for_model(local, dtype=dtype, quantization=quantization,
                                           overrides=overrides, tp_rank=tp_rank)
        except FileNotFoundError as exc:
            logger.warning("model identity: %s", exc)
    # No weight files to digest (dummy weights, or a loader reading from elsewhere): a name
    # unique to this process, so its KV is shared with no one rather than with the wrong one.
    logger.warning("tier keys of %s are private to this server: its weights cannot be "
                   "identified by content", model_path)
    return ModelIdentity(name=Path(model_path).name or "model",
                         weights=f"private:{uuid.uuid4()}", config=None, dtype=dtype,
                         quantization=quantization, overrides=canonical_json(overrides),
                         tp_rank=tp_rank)


def tier_geometry_source(identity: ModelIdentity, num_layers: int, num_kv_heads: int,
                         head_dim: int, kv_dtype: Any, chunk_tokens: int
                         ) -> Callable[[], KVGeometry]:
    """A callable giving the tier geometry for the current weight version (cached per
    version: the remote link calls it on every poll)."""

    @lru_cache(maxsize=4)
    def at_version(version: int) -> KVGeometry:
        current = identity.with_weight_version(version)
        logger.info("tier keys name the model %s", current.describe())
        return KVGeometry.from_torch_dtype(current.model_id(), num_layers, num_kv_heads,
                                           head_dim, kv_dtype, chunk_tokens)

    return lambda: at_version(weight_version())
