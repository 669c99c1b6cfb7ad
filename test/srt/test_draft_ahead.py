"""Drafting while fetching: the standalone drafter against transformers, the proposals.

The drafter runs SGLang's Llama modules outside SGLang's batches. Here the same math runs on a
tiny random-weight transformers Llama wrapped in SGLang's module layout (fused qkv_proj
returning ``(out, bias)``, a neox cos/sin cache, ``variance_epsilon`` norms), and must give
transformers' own logits when the "compressed" prefix is the exact KV.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from sglang_vericache.compress import Full
from sglang_vericache.srt.prefix.draft_ahead import DraftAhead
from sglang_vericache.srt.kv.draft_state import RequestDraftState
from sglang_vericache.srt.prefix.llama_drafter import LlamaDrafter
from sglang_vericache.tier.demoted import DemotedPrefixes

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 2, 64, 4, 2, 97


class _RoomyPool:
    """A ``PoolAccount`` with room for every entry: these tests are about drafting (the
    accounting is ``test/unit/tier/test_demoted.py`` and ``test_demoted_pool.py``)."""

    def slots_for(self, nbytes: int) -> int:
        return 1

    def take(self, n: int) -> object:
        return object()

    def give_back(self, held: object) -> None:
        pass


def _hub() -> DraftAhead:
    return DraftAhead(DemotedPrefixes(_RoomyPool()))


@pytest.fixture(scope="module")
def hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                         rope_theta=10000.0)  # fmt: skip
    return LlamaForCausalLM(config).eval()


class _Fused(nn.Module):
    """SGLang's linear layers return (output, bias)."""

    def __init__(self, *parts: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.cat([p.weight for p in parts]))

    def forward(self, x):
        return x @ self.weight.T, None


class _Rope:
    is_neox_style = True

    def __init__(self, head_dim: int, theta: float, max_pos: int) -> None:
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.rotary_dim = head_dim


def _sglang_layout(hf) -> nn.Module:
    """The transformers model's weights in SGLang's Llama module layout."""
    cfg, d = hf.config, hf.config.hidden_size // hf.config.num_attention_heads
    layers = []
    for layer in hf.model.layers:
        a, m = layer.self_attn, layer.mlp
        attn = nn.Module()
        attn.qkv_proj = _Fused(a.q_proj, a.k_proj, a.v_proj)
        attn.o_proj = _Fused(a.o_proj)
        attn.rotary_emb = _Rope(d, cfg.rope_parameters["rope_theta"], cfg.max_position_embeddings)
        attn.num_heads, attn.num_kv_heads, attn.head_dim = HEADS, KV_HEADS, d
        attn.scaling = d**-0.5
        out = nn.Module()
        out.self_attn, out.mlp = attn, m
        out.input_layernorm, out.post_attention_layernorm = (layer.input_layernorm,
                                                             layer.post_attention_layernorm)  # fmt: skip
        for norm in (out.input_layernorm, out.post_attention_layernorm):
            norm.variance_epsilon = cfg.rms_norm_eps
        layers.append(out)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(layers)
    model.model.embed_tokens = hf.model.embed_tokens
    model.model.norm = hf.model.norm
    model.model.norm.variance_epsilon = cfg.rms_norm_eps
    model.lm_head = hf.lm_head
    return model


def _exact_state(hf, tokens: list[int], appended: int = 0) -> RequestDraftState:
    """A 'compressed' state that is the exact KV of ``tokens`` (the Full compressor).

    The last ``appended`` tokens are added the way verifications add committed tokens.
    """
    with torch.no_grad():
        cache = hf(torch.tensor([tokens]), use_cache=True).past_key_values
    kv = [(cache.layers[i].keys[0], cache.layers[i].values[0]) for i in range(LAYERS)]
    built = len(tokens) - appended
    state = RequestDraftState.build(Full(), lambda layer: [t[:, :built] for t in kv[layer]],
                                    built, [None] * LAYERS, LAYERS)  # fmt: skip
    slots = torch.arange(built, len(tokens))
    state.append(lambda layer, at: (kv[layer][0][:, at], kv[layer][1][:, at]), slots,
                 [None] * LAYERS)  # fmt: skip
    return state


def _hf_greedy(hf, tokens: list[int], n: int) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(hf(torch.tensor([tokens + out])).logits[0, -1].argmax())
            out.append(nxt)
    return out


def test_drafter_on_the_exact_prefix_matches_transformers(hf_model) -> None:
    drafter = LlamaDrafter.from_model(_sglang_layout(hf_model))
    assert drafter is not None
    tokens = torch.randint(0, VOCAB, (40,)).tolist()
    prefix, suffix = tokens[:29], tokens[29:]
    logits, kv = drafter.prefill(_exact_state(hf_model, prefix).views(), suffix, len(prefix), 4)
    with torch.no_grad():
        want = hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits, want[-1], atol=1e-4, rtol=1e-4)
    # the same prefill in two chunks (drafting ahead pauses between them for the serving path)
    _, chunked = drafter.prefill(_exact_state(hf_model, prefix).views(), suffix[:5], len(prefix),
                                 len(suffix) - 5 + 4)  # fmt: skip
    torch.testing.assert_close(drafter.extend(suffix[5:], chunked), want[-1], atol=1e-4, rtol=1e-4)
    step = drafter.step(7, kv)
    with torch.no_grad():
        want_step = hf_model(torch.tensor([tokens + [7]])).logits[0, -1]
    torch.testing.assert_close(step, want_step, atol=1e-4, rtol=1e-4)


def test_a_model_without_the_llama_layout_gets_no_drafter() -> None:
    assert LlamaDrafter.from_model(nn.Linear(4, 4)) is None


@pytest.mark.parametrize("kept", [30, 28], ids=["whole", "committed-past-the-end"])
def test_draft_ahead_drafts_the_greedy_continuation_on_its_thread(hf_model, kept: int) -> None:
    turn1 = torch.randint(0, VOCAB, (30,)).tolist()
    prompt = turn1[:kept] + [5, 6, 7]
    hub = _hub()
    hub.attach(_sglang_layout(hf_model))
    hub.park("r1", _exact_state(hf_model, turn1, appended=5))
    # The request kept `kept` tokens: longer keys are cut to what the state covers, shorter
    # ones trim the newest committed tokens off the state's views.
    assert hub.remember("r1", turn1[:kept] + [11] * (kept == 30))
    assert hub.store.longest(prompt).tokens == tuple(turn1[:kept])
    assert hub.start("r2", prompt, max_new_tokens=6)
    time.sleep(0.3)
    assert hub.drafts("r2") == []  # the serving path is busy: no compute taken from it
    hub.serving_idle()
    deadline = time.monotonic() + 30
    while len(hub.drafts("r2")) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    want = _hf_greedy(hf_model, prompt, 6)
    assert hub.drafts("r2") == want
    # Verification committed want[0], want[1]: the next proposals continue the chain.
    assert hub.proposals([("r2", want[:2])], most=3) == [want[2:5]]
    assert hub.proposals([("r2", want[:5])], most=3) == [want[5:6]]
    # Output left the drafts: nothing proposed, the job is forgotten.
    assert hub.proposals([("r2", [want[0] + 1])], most=3) is None
    assert hub.drafts("r2") == []
    assert not hub.start("r3", [1, 2, 3], max_new_tokens=4)  # no stored prefix of it
    hub.close()


def test_proposals_need_every_request_of_the_batch() -> None:
    hub = _hub()
    hub.jobs["a"] = _job("a", [1, 2, 3, 4])
    assert hub.proposals([("a", [1]), ("b", [9])], most=8) is None
    assert "a" in hub.jobs  # still good: only the batch lacked b
    hub.jobs["b"] = _job("b", [9, 8])
    assert hub.proposals([("a", [1]), ("b", [9])], most=8) == [[2], [8]]
    assert hub.proposals([("a", []), ("b", [9])], most=8) is None  # a has no first token yet


def _job(rid: str, drafts: list[int]):
    from sglang_vericache.srt.prefix.draft_ahead import AheadJob
    from sglang_vericache.tier.demoted import DemotedPrefix

    return AheadJob(rid, DemotedPrefix((0,), None, 0, 0, None, 0), [], 8, drafts=list(drafts))


def test_start_skips_a_request_whose_fetch_lands_before_a_draft_could(hf_model) -> None:
    turn1 = torch.randint(0, VOCAB, (30,)).tolist()
    hub = _hub()
    hub.attach(_sglang_layout(hf_model))
    hub.park("r1", _exact_state(hf_model, turn1))
    assert hub.remember("r1", turn1)
    prompt = turn1 + list(range(10))
    hub.prefill_s_per_token = 0.01  # 10 suffix tokens: 0.1 s before the first draft
    assert not hub.start("late", prompt, 4, wait_s=0.05)
    assert not hub.start("late", prompt, 4, wait_s=5.0)  # decided once per request
    assert hub.skipped == 1 and "late" not in hub.jobs
    assert hub.start("early", prompt, 4, wait_s=0.5)
    assert hub.start("unknown", prompt, 4, wait_s=None)  # no estimate yet: draft
    hub.close()
    assert not hub.jobs and hub._thread is None
