"""Batched Llama forward over per-chain KV buffers, for the compressor benchmark (CPU).

Drafting from a compressed cache is a 1-token decode over a KV that differs per chain (kept
tokens, dequantized values, lengths). HF's cache assumes one length per batch, so this runs the
HF model's own modules (norms, projections, rotary, MLP, head) over padded per-chain buffers with
a validity mask: one weight read serves a whole batch of chains, which is what makes the
benchmark fit in its CPU budget. Original positions are baked into the keys by RoPE, so the
order of slots inside a buffer does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Geometry:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def geometry(model: torch.nn.Module) -> Geometry:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Geometry(
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        head_dim,
        next(model.parameters()).dtype,
    )


@dataclass(frozen=True, slots=True)
class Prefill:
    """Full-KV prefill of one prompt.

    keys/values: per layer [H_kv, T, D] post-RoPE; last_queries: per layer [H_q, W, D];
    attention: per layer [H_kv, T] accumulated attention from every ``stride``-th query (or None);
    first_token: greedy token after the prompt.
    """

    keys: list[Tensor]
    values: list[Tensor]
    last_queries: list[Tensor]
    attention: list[Tensor] | None
    first_token: int


class DraftEngine:
    """Runs prefill and batched 1-token decode steps of a HF Llama-architecture model."""

    def __init__(self, model: torch.nn.Module, banned_token: int | None = None) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.model = model
        self.geo = geometry(model)
        self._rope = apply_rotary_pos_emb
        self.banned_token = banned_token  # e.g. EOS: suppressed so every prompt yields the horizon

    def _qkv(
        self, layer: torch.nn.Module, x: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        g = self.geo
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        b, s, _ = h.shape
        q = attn.q_proj(h).view(b, s, g.num_q_heads, g.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(b, s, g.num_kv_heads, g.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(b, s, g.num_kv_heads, g.head_dim).transpose(1, 2)
        q, k = self._rope(q, k, cos, sin)
        return q, k, v

    def _finish_layer(self, layer: torch.nn.Module, x: Tensor, o: Tensor) -> Tensor:
        b, _, s, _ = o.shape
        x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _logits(self, x: Tensor) -> Tensor:
        m = self.model
        logits = m.lm_head(m.model.norm(x)).float()
        if self.banned_token is not None:
            logits[..., self.banned_token] = float("-inf")
        return logits

    @torch.inference_mode()
    def prefill(self, ids: Tensor, obs_window: int, attention_stride: int | None) -> Prefill:
        """ids: [T] int64. attention_stride: every k-th query feeds the H2O accumulation, or None."""
        m, g = self.model, self.geo
        t = ids.numel()
        x = m.model.embed_tokens(ids[None])
        pos = torch.arange(t)[None]
        cos, sin = m.model.rotary_emb(x, pos)
        keys, values, lastq, accs = [], [], [], []
        for layer in m.model.layers:
            q, k, v = self._qkv(layer, x, cos, sin)
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True, scale=layer.self_attn.scaling
            )
            keys.append(k[0].contiguous())
            values.append(v[0].contiguous())
            lastq.append(q[0, :, -obs_window:].contiguous())
            if attention_stride is not None:
                accs.append(
                    _accumulated_attention(q[0], k[0], attention_stride, layer.self_attn.scaling)
                )
            x = self._finish_layer(layer, x, o)
        first = int(self._logits(x[:, -1]).argmax(dim=-1)[0])
        return Prefill(keys, values, lastq, accs if attention_stride is not None else None, first)

    @torch.inference_mode()
    def step(
        self,
        buffers: DraftBuffers,
        tokens: Tensor,
        positions: Tensor,
        capture: bool = False,
        logprobs: bool = False,
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor, Tensor]] | None, Tensor | None]:
        """One decode step for every chain of ``buffers``.

        tokens, positions: [B] int64. The new token's K/V go to slot ``lengths[l, b]`` of each
        layer, which then grows by one. Returns (next greedy token [B], per layer (q [B, H_q, D],
        k [B, H_kv, D], v [B, H_kv, D]) when ``capture``, next-token log-probs [B, V] float32
        when ``logprobs``).
        """
        m = self.model
        b = tokens.numel()
        x = m.model.embed_tokens(tokens[:, None])
        cos, sin = m.model.rotary_emb(x, positions[:, None])
        rows = torch.arange(b)
        captured = [] if capture else None
        for li, layer in enumerate(m.model.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            slot = buffers.lengths[li]
            buffers.keys[li][rows, :, slot] = k[:, :, 0]
            buffers.values[li][rows, :, slot] = v[:, :, 0]
            slot += 1
            span = int(slot.max())
            mask = (torch.arange(span)[None, :] < slot[:, None])[:, None, None, :]
            o = F.scaled_dot_product_attention(
                q,
                buffers.keys[li][:, :, :span],
                buffers.values[li][:, :, :span],
                attn_mask=mask,
                enable_gqa=True,
                scale=layer.self_attn.scaling,
            )
            if captured is not None:
                captured.append((q[:, :, 0].clone(), k[:, :, 0].clone(), v[:, :, 0].clone()))
            x = self._finish_layer(layer, x, o)
        logits = self._logits(x[:, 0])
        return logits.argmax(dim=-1), captured, logits.log_softmax(-1) if logprobs else None


def _accumulated_attention(q: Tensor, k: Tensor, stride: int, scale: float) -> Tensor:
    """[H_kv, T]: attention each key gets from every ``stride``-th query (GQA group mean)."""
    h_q, t, d = q.shape
    h_kv = k.shape[0]
    qs = q[:, stride - 1 :: stride].float()
    qpos = torch.arange(stride - 1, t, stride)
    logits = torch.einsum("hwd,htd->hwt", qs, k.float().repeat_interleave(h_q // h_kv, 0)) * scale
    logits = logits.masked_fill(torch.arange(t)[None, None, :] > qpos[None, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).sum(dim=1)
    return probs.view(h_kv, h_q // h_kv, t).mean(dim=1)


class DraftBuffers:
    """Per-layer padded KV buffers of B chains: keys[l]: [B, H_kv, S, D]; lengths: [L, B] int64."""

    def __init__(self, geo: Geometry, batch: int, capacity: int) -> None:
        shape = (batch, geo.num_kv_heads, capacity, geo.head_dim)
        self.keys = [torch.zeros(shape, dtype=geo.dtype) for _ in range(geo.num_layers)]
        self.values = [torch.zeros(shape, dtype=geo.dtype) for _ in range(geo.num_layers)]
        self.lengths = torch.zeros(geo.num_layers, batch, dtype=torch.int64)
        self.capacity = capacity

    def write(self, layer: int, chain: int, start: int, keys: Tensor, values: Tensor) -> None:
        """Writes keys/values [H_kv, n, D] to slots [start, start + n); length becomes start + n."""
        n = keys.shape[1]
        if start + n > self.capacity:
            raise ValueError(f"draft buffer overflow: {start + n} > {self.capacity}")
        self.keys[layer][chain, :, start : start + n] = keys
        self.values[layer][chain, :, start : start + n] = values
        self.lengths[layer, chain] = start + n
