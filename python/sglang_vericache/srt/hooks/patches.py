"""The patches VeriCache applies to SGLang (0.5.23), and why they cannot be avoided.

1. ``sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func`` writes freshly allocated KV
slots into request rows. Speculative decoding (every ``--speculative-algorithm``, so VERICACHE
too) reaches it through ``alloc_for_spec_decode``, and on an out-of-tree platform it launches a
Triton kernel, which needs a GPU; SGLang's own CPU branch is taken only for its sgl_kernel CPU
engine, and no platform hook chooses the implementation. The AROUND hook below keeps the
original for device tensors and writes the rows with torch when they live on the CPU.

2. ``meta_info["vericache"]`` rides SGLang's per-request ``customized_info`` channel, which is
per *token*: each send to the tokenizer carries ``req.customized_info[key][offset:len(output)]``
for the tokens it streams, and ``TokenizerManager._accumulate_request_meta_info`` turns the
values into a growing list. A verify step commits several tokens but a worker result carries one
value per step, so SGLang's own collection would leave later sends empty (and the final
response without the key). ``publish_meta_info`` therefore keeps the request's latest counters
at every token index, and the AROUND hook keeps only the newest value: ``meta_info["vericache"]``
is one dict (drafted, accepted, verify steps, ...), current at every send.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

TARGET = "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"
META_TARGET = (
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._accumulate_request_meta_info"
)
META_INFO_KEY = "vericache"


def assign_rows_torch(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """req_to_token[row_i, start_i:end_i] = the next (end_i - start_i) entries of out_cache_loc.

    req_pool_indices, start_offset, end_offset: [bs] integer; out_cache_loc: [sum(end - start)].
    """
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    ):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _assign_around(original: Callable[..., Any], req_pool_indices, req_to_token, start_offset,
                   end_offset, out_cache_loc, batch_size, *args: Any, **kw: Any) -> Any:  # fmt: skip
    if req_to_token.device.type != "cpu":
        return original(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                        batch_size, *args, **kw)  # fmt: skip
    assign_rows_torch(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc)
    return None


def _meta_info_around(original: Callable[..., Any], meta_info: dict, state: Any, key: str,
                      values: list) -> None:  # fmt: skip
    if key != META_INFO_KEY:
        return original(meta_info, state, key, values)
    if values:
        meta_info[key] = values[-1]  # cumulative counters: the newest supersedes the rest
    return None


def publish_meta_info(req: Any, info: dict, upto: int) -> None:
    """Make ``info`` the request's ``meta_info["vericache"]`` for every token index < ``upto``
    (at least its output length after this step); see point 2 of the module doc."""
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[META_INFO_KEY] = [info] * upto


def register_patches() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _assign_around, HookType.AROUND)
    HookRegistry.register(META_TARGET, _meta_info_around, HookType.AROUND)
