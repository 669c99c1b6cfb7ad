"""Fixtures for the compressor tests: real post-RoPE K/V/Q from a tiny random Llama."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from sglang_vericache.compress import Observation

OBS_WINDOW = 8


@dataclass(frozen=True)
class LayerKV:
    """Per layer: keys/values [H_kv, T, D] post-RoPE, last queries [H_q, W, D], attention [H_kv, T]."""

    keys: list[Tensor]
    values: list[Tensor]
    queries: list[Tensor]
    attention: list[Tensor]
    num_q_heads: int
    next_keys: list[Tensor]  # KV/queries of 40 more tokens (decode-time growth)
    next_values: list[Tensor]
    next_queries: list[Tensor]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[1]

    def obs(self, layer: int) -> Observation:
        t = self.num_tokens
        return Observation(self.queries[layer], torch.arange(t - OBS_WINDOW, t), self.attention[layer],
                           self.num_layers)


def _run(model, ids: Tensor) -> tuple[list, list, list, list]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    out = model(ids[None], use_cache=True, output_hidden_states=True, output_attentions=True)
    cache = out.past_key_values
    keys = [layer.keys[0] for layer in cache.layers]
    values = [layer.values[0] for layer in cache.layers]
    pos = torch.arange(ids.numel())[None]
    cos, sin = model.model.rotary_emb(out.hidden_states[0], pos)
    queries, attention = [], []
    for li, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(out.hidden_states[li])
        q = attn.q_proj(h).view(1, ids.numel(), -1, attn.head_dim).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        queries.append(q[0])
        a = out.attentions[li][0]  # [H_q, T, T]
        g = a.shape[0] // keys[li].shape[0]
        attention.append(a.sum(dim=1).view(keys[li].shape[0], g, -1).mean(dim=1))
    return keys, values, queries, attention


@pytest.fixture(scope="session")
def tiny_kv() -> LayerKV:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (240,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        keys, values, queries, attention = _run(model, ids)
    t = 200
    return LayerKV(
        [k[:, :t].contiguous() for k in keys],
        [v[:, :t].contiguous() for v in values],
        [q[:, t - OBS_WINDOW : t].contiguous() for q in queries],
        [a[:, :t].contiguous() for a in attention],  # the attention of all 240 queries, cut to T
        cfg.num_attention_heads,
        [k[:, t:].contiguous() for k in keys],
        [v[:, t:].contiguous() for v in values],
        [q[:, t:].contiguous() for q in queries],
    )


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    """Small matmuls with 2 OpenMP threads stall badly on the shared 2-core box; 1 is faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
