"""The model identity this SGLang process puts into its tier keys, and how weight updates move it.

``tier/identity.py`` computes an identity from plain values; this module reads them from the
server: the model path (a local directory, or the local snapshot of a hub id), the resolved
weight dtype and quantization, the arguments that change the model's numbers, and the TP rank.

Weight updates. SGLang 0.5.23 changes a running server's weights through
``SchedulerWeightUpdaterManager.update_weights_from_{disk,tensor,distributed,ipc}`` and, for
loads that bypass those (P2P/RDMA), between ``begin_weight_update`` and ``end_weight_update``;
``resume_memory_occupation`` may bring weights back from elsewhere. ``ServedWeights`` follows:

- a load from disk: the identity of the checkpoint loaded, computed as at start-up (content
  digest, cached per file version): a server updated to a checkpoint shares keys with every
  server serving it, whether started from it or updated to it. The hook sits on the model
  runner's ``WeightUpdater.update_weights_from_disk``, whose answer says whether the load went
  through (the manager's also fails when the weights changed but the cache could not be
  flushed, as under ``pause_generation(mode="in_place")``);
- every other change, and a disk load that failed (SGLang's rollback reloads from the new
  path: the weights are unknown): a private identity, a fresh nonce, so the server shares
  nothing until it loads named weights from disk again. Digesting the received tensors was
  not chosen: it would copy every tensor to the host on the scheduler thread (the whole model,
  in an RL weight sync), and the tensors of a partial update do not name the weights they join.

Every change, to the same identity too, also moves ``ServedWeights.generation`` on: KV
computed under one generation is never filed under another (``srt/prefix/tier_eligibility.py``);
and, with or without a tier, it marks the draft path's shadow weights stale (remade before the
next draft: ``srt/attention/draft_precision.py``). The
hooks wrap the calls (AROUND) so that an update that raises moves it as well. They are
registered with SGLang's HookRegistry (applied by SGLang after plugins load), like every other
hook of this package, and find a scheduler's ``ServedWeights`` in its context
(``srt/context.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sglang_vericache.srt.context import VeriContext, context_of, has_context, open_context
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.identity import ModelIdentity, canonical_json

logger = logging.getLogger(__name__)

WEIGHT_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater." \
    "SchedulerWeightUpdaterManager"
RUNNER_WEIGHT_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater." \
    "WeightUpdater"
DISK_LOAD = "update_weights_from_disk"  # RUNNER_WEIGHT_UPDATER's: (model_path, load_format, ...)
# WEIGHT_UPDATER's calls that change weights to something this process cannot name
UNNAMED_WEIGHT_CHANGES = (
    "update_weights_from_tensor", "update_weights_from_distributed", "update_weights_from_ipc",
    "begin_weight_update", "end_weight_update", "resume_memory_occupation",
)
# ServerArgs fields that change the model's numbers beyond weights, config and dtype. Unset
# values (None, "", "auto", "{}") are left out, so two servers started alike hash alike.
# (SGLang's --weight-version is a label, not content: the weights digest names the weights.)
OVERRIDE_ARGS = (
    "json_model_override_args", "revision", "load_format", "model_impl",
    "model_loader_extra_config", "quantization_param_path", "modelopt_quant",
    "rl_quant_profile", "custom_weight_loader",
)


class ServedWeights:
    """The weights one scheduler serves now, as its tier keys name them (module doc).

    identity: what every tier key names now.
    generation: weight changes since start (0: the weights loaded at start-up).
    Scheduler thread only: SGLang runs weight updates and the prefix cache there.
    """

    def __init__(self, identity: ModelIdentity) -> None:
        self.identity = identity
        self.generation = 0

    def attach(self, req_to_token_pool: Any) -> None:
        """Where the weight-update hooks find it: the scheduler's context (``srt/context.py``)."""
        open_context(req_to_token_pool).served = self

    def loaded_from_disk(self, model_path: str, load_format: str | None) -> None:
        self._move_to(checkpoint_identity(self.identity, model_path, load_format),
                      f"loaded {model_path}")  # fmt: skip

    def changed_unnamed(self, reason: str) -> None:
        self._move_to(self.identity.private(), reason)

    def _move_to(self, identity: ModelIdentity, reason: str) -> None:
        self.identity = identity
        self.generation += 1
        logger.info("model weights changed (%s): tier keys now name %s", reason,
                    identity.describe())

    def geometry_source(self, num_layers: int, num_kv_heads: int, head_dim: int,
                        kv_dtype: Any, chunk_tokens: int) -> Callable[[], KVGeometry]:
        """A callable giving the tier geometry of the weights served now (cached per
        generation: the remote link calls it on every poll)."""
        cached: dict[int, KVGeometry] = {}

        def now() -> KVGeometry:
            geometry = cached.get(self.generation)
            if geometry is None:
                cached.clear()
                logger.info("tier keys name the model %s", self.identity.describe())
                geometry = cached[self.generation] = KVGeometry.from_torch_dtype(
                    self.identity.model_id(), num_layers, num_kv_heads, head_dim, kv_dtype,
                    chunk_tokens)  # fmt: skip
            return geometry

        return now


def _served_context(model_runner: Any) -> VeriContext | None:
    """The context of the scheduler whose served model ``model_runner`` runs (None for a
    draft model's runner: its weights are neither the KV's nor the drafts', or without one)."""
    if model_runner is None or getattr(model_runner, "is_draft_worker", False):
        return None
    pool = getattr(model_runner, "req_to_token_pool", None)
    return context_of(pool) if has_context(pool) else None


def served_weights_of(model_runner: Any) -> ServedWeights | None:
    """The ``ServedWeights`` of the scheduler that owns ``model_runner`` (None without a
    remote tier, or for a draft model's runner: its weights are not the KV's)."""
    context = _served_context(model_runner)
    return None if context is None else context.served


def _draft_shadows_stale(model_runner: Any) -> None:
    """The draft path's shadow weights (``srt/attention/draft_precision.py``) are remade before
    the next draft: whatever the update did, the model's tensors may hold other numbers now."""
    context = _served_context(model_runner)
    if context is not None and context.draft_precision is not None:
        context.draft_precision.weights_changed()


def _around_disk_load(original: Callable[..., Any], updater: Any, model_path: str,
                      load_format: str | None, *args: Any, **kwargs: Any) -> Any:
    loaded = False
    try:
        result = original(updater, model_path, load_format, *args, **kwargs)
        loaded = bool(result[0])
        return result
    finally:
        runner = updater.get_model_runner()
        _draft_shadows_stale(runner)
        served = served_weights_of(runner)
        if served is not None and loaded:
            served.loaded_from_disk(model_path, load_format)
        elif served is not None:
            served.changed_unnamed(f"{DISK_LOAD} of {model_path} failed")


def _around_unnamed_change(method: str) -> Callable[..., Any]:
    def hook(original: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(manager, *args, **kwargs)
        finally:
            runner = getattr(getattr(manager, "tp_worker", None), "model_runner", None)
            _draft_shadows_stale(runner)
            served = served_weights_of(runner)
            if served is not None:
                served.changed_unnamed(method)

    hook.__name__ = f"vericache_around_{method}"
    return hook


def register_weight_version_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{RUNNER_WEIGHT_UPDATER}.{DISK_LOAD}", _around_disk_load,
                          HookType.AROUND)  # fmt: skip
    for method in UNNAMED_WEIGHT_CHANGES:
        HookRegistry.register(f"{WEIGHT_UPDATER}.{method}", _around_unnamed_change(method),
                              HookType.AROUND)  # fmt: skip


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
    """This server's identity at start-up (``ServedWeights`` moves it on weight updates)."""
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
    return ModelIdentity(name=Path(model_path).name or "model", weights="-", config=None,
                         dtype=dtype, quantization=quantization,
                         overrides=canonical_json(overrides), tp_rank=tp_rank).private()


def checkpoint_identity(base: ModelIdentity, model_path: str, load_format: str | None
                        ) -> ModelIdentity:
    """The identity of a server like ``base`` started from ``model_path`` with ``load_format``
    (what it serves after ``update_weights_from_disk(model_path, load_format)``): the same
    dtype, quantization, other overrides and TP rank; no ``--revision`` (an update loads the
    path as it is). Private when the checkpoint cannot be digested."""
    overrides = {k: v for k, v in json.loads(base.overrides).items()
                 if k not in ("revision", "load_format")}  # fmt: skip
    if not _is_unset(load_format):
        overrides["load_format"] = load_format
    named = dataclasses.replace(base, name=Path(model_path).name or "model",
                                overrides=canonical_json(overrides))  # fmt: skip
    local = None if load_format == "dummy" else local_model_path(model_path, None)
    if local is not None:
        try:
            return ModelIdentity.for_model(local, dtype=base.dtype,
                                           quantization=base.quantization,
                                           overrides=overrides, tp_rank=base.tp_rank)  # fmt: skip
        except (OSError, ValueError) as exc:
            logger.warning("model identity of %s: %s", model_path, exc)
    logger.warning("tier keys of %s are private to this server: its weights cannot be "
                   "identified by content", model_path)
    return named.private()
