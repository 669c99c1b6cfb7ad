"""A standalone greedy drafter over a compressed KV, for drafting before a request is admitted.

While a request waits in SGLang's queue for its full-KV prefix to arrive from the remote tier it
has no pool row, no ``ForwardBatch`` and no place in a batch, so SGLang's forward cannot draft for
it. This module runs the *same weights* (the model runner's Llama-family modules) in plain torch:

    views    per layer (K, V) [H_kv, T_c, D]: the compressed prefix (post-RoPE keys)
    tokens   the prompt's tokens past the compressed prefix, at positions start..start+S-1
    prefill  one causal pass over the S tokens, attending to views + themselves -> logits
    step     one token at a time, attending to views + every token drafted so far -> logits

Drafts only ever *propose*: the full-KV verification decides every committed token, so numeric
differences from SGLang's kernels can lower acceptance but never change an output. Models
whose modules do not have the Llama layout (``LlamaDrafter.from_model`` returns None) simply
wait for their fetch as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

_LAYER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
_ATTN_PARTS = ("qkv_proj", "o_proj", "rotary_emb", "num_heads", "num_kv_heads", "head_dim")


def _rms_norm(norm, x: Tensor) -> Tensor:
    """SGLang's RMSNorm in plain torch (its own forward may pick a fused kernel)."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + norm.variance_epsilon)).to(x.dtype) * norm.weight


@dataclass(slots=True)
class DraftKV:
    """Per-layer K/V of one draft: the compressed prefix, then every token run so far.

    keys[layer] / values[layer]: [H_kv, prefix[layer] + capacity, D]; rows
    [0, prefix[layer]) hold the compressed prefix (its length differs between layers for
    per-layer budgets), the next ``ran`` rows the tokens run so far, at positions
    next_pos - ran .. next_pos - 1.
    """

    keys: list[Tensor]
    values: list[Tensor]
    prefix: list[int]
    ran: int
    next_pos: int

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] - self.prefix[0]


class LlamaDrafter:
    """Greedy drafting with a Llama-family model's weights, outside SGLang's batches."""

    def __init__(self, model) -> None:
        self.model = model
        self.layers = list(model.model.layers)
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.scaling = getattr(attn, "scaling", self.head_dim**-0.5)

    @classmethod
    def from_model(cls, model) -> "LlamaDrafter | None":
        """A drafter for ``model``, or None when its modules are not laid out like Llama's."""
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm")):
            return None
        if not hasattr(model, "lm_head") or not hasattr(model.lm_head, "weight"):
            return None
        for layer in inner.layers:
            if not all(hasattr(layer, p) for p in _LAYER_PARTS):
                return None
            attn = layer.self_attn
            rope = getattr(attn, "rotary_emb", None)
            if not all(hasattr(attn, p) for p in _ATTN_PARTS) or rope is None:
                return None
            if not getattr(rope, "is_neox_style", False) or not hasattr(rope, "cos_sin_cache"):
                return None
            if getattr(rope, "rotary_dim", attn.head_dim) != attn.head_dim:
                return None
        return cls(model)

    # -- public ------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, views: list[tuple[Tensor, Tensor]], tokens: list[int], start: int,
                capacity: int) -> tuple[Tensor, DraftKV]:  # fmt: skip
        """Run ``tokens`` at positions start.. over ``views``; logits of the last one: [V].

        capacity: extra tokens the returned ``DraftKV`` can take after these (for ``step``).
        """
        keys, values, prefix = [], [], []
        for k, v in views:
            n = k.shape[1]
            kb = k.new_empty(k.shape[0], n + len(tokens) + capacity, k.shape[2])
            vb = v.new_empty(v.shape[0], n + len(tokens) + capacity, v.shape[2])
            kb[:, :n], vb[:, :n] = k, v
            keys.append(kb)
            values.append(vb)
            prefix.append(n)
        kv = DraftKV(keys, values, prefix, 0, start)
        return self._run(tokens, kv), kv

    @torch.inference_mode()
    def extend(self, tokens: list[int], kv: DraftKV) -> Tensor:
        """Run ``tokens`` after everything in ``kv`` (a prefill in chunks); logits of the
        last one: [V]."""
        if kv.ran + len(tokens) > kv.capacity:
            raise ValueError("DraftKV is full: ask prefill for more capacity")
        return self._run(tokens, kv)

    def step(self, token: int, kv: DraftKV) -> Tensor:
        """Run one token after everything in ``kv``; its logits: [V]."""
        return self.extend([token], kv)

    # -- the forward -------------------------------------------------------------------------

    def _run(self, tokens: list[int], kv: DraftKV) -> Tensor:
        """Tokens [S] at kv.next_pos..; appends their K/V; logits of the last one: [V]."""
        device = self.model.lm_head.weight.device
        ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        positions = torch.arange(kv.next_pos, kv.next_pos + len(tokens), device=device)
        hidden = self.model.model.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            lo = kv.prefix[i] + kv.ran
            attn_in = _rms_norm(layer.input_layernorm, hidden)
            hidden = hidden + self._attention(layer.self_attn, attn_in, positions, kv, i, lo,
                                              lo + len(tokens))  # fmt: skip
            hidden = hidden + layer.mlp(_rms_norm(layer.post_attention_layernorm, hidden))
        kv.ran, kv.next_pos = kv.ran + len(tokens), kv.next_pos + len(tokens)
        # Only the last token's logits are used: [V, H] x [H] instead of [S, H] x [H, V].
        out = _rms_norm(self.model.model.norm, hidden[-1])
        return self.model.lm_head.weight @ out

    def _attention(self, attn, x: Tensor, positions: Tensor, kv: DraftKV, layer: int,
                   lo: int, hi: int) -> Tensor:  # fmt: skip
        """Causal attention of the new tokens [S] over kv[0:hi]; writes their K/V at [lo, hi)."""
        s, d = x.shape[0], self.head_dim
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q, k = _rope(attn.rotary_emb, positions, q.view(s, -1, d), k.view(s, -1, d))
        kv.keys[layer][:, lo:hi] = k.transpose(0, 1)
        kv.values[layer][:, lo:hi] = v.view(s, -1, d).transpose(0, 1)
        group = self.num_heads // self.num_kv_heads
        keys = kv.keys[layer][:, :hi].repeat_interleave(group, dim=0)  # [H_q, hi, D]
        values = kv.values[layer][:, :hi].repeat_interleave(group, dim=0)
        # Query j (at row lo + j) sees every prefix entry and the new tokens up to itself.
        mask = torch.ones(s, hi, dtype=torch.bool, device=x.device)
        mask[:, lo:] = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=mask, scale=self.scaling
        )  # [H_q, S, D]
        o, _ = attn.o_proj(out.transpose(0, 1).reshape(s, -1))
        return o


def _rope(rope, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """Neox-style rotary embedding from the module's cos/sin cache; q [S, H, D], k [S, H_kv, D]."""
    cos, sin = rope.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)

    def rotate(x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)
