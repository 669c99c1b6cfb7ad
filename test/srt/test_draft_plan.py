"""A draft forward's attention (``srt/draft_attention.DraftPlan``): every row's compressed view
and draft chain, read in place by the CPU kernel, a GPU's pool decoders (FlashInfer's torch
reference and the Triton kernel under its CPU interpreter here) or per row."""

from __future__ import annotations

import pytest
import torch
from test_worker_parts import D, H_KV, H_Q, LAYERS, T, LayerPool, layer_reader, pool, reader  # noqa: F401

from sglang_vericache.compress import build_compressor

pytestmark = pytest.mark.sglang


def _lodge(pool, states) -> None:
    """Lodge each state in a draft row of ``pool``'s slots 300.. (clear of the test's tokens)."""
    from sglang_vericache.srt.kv.draft_rows import DraftRow

    free = iter(range(300, 512))
    take = lambda n: torch.tensor([next(free) for _ in range(n)], dtype=torch.int64)  # noqa: E731
    for state in states:
        assert DraftRow(LayerPool(pool), take).lodge(state) == LAYERS


def _reference_draft_attention(q, state, pool, layer, chain):
    """Row-by-row attention over cat(view, chain KV): what the padded batch must equal."""
    from torch.nn.functional import scaled_dot_product_attention

    keys, values = pool[layer][0][chain].transpose(0, 1), pool[layer][1][chain].transpose(0, 1)
    if state is not None:
        vk, vv = state.views()[layer]
        keys, values = torch.cat([vk, keys], dim=1), torch.cat([vv, values], dim=1)
    out = scaled_dot_product_attention(q[None, :, None], keys[None], values[None], scale=0.25,
                                       enable_gqa=True)  # fmt: skip
    return out[0, :, 0]


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.5", "kivi:bits=4",
                                  "pyramid(snapkv:ratio=0.5):beta=2", "full"])  # fmt: skip
@pytest.mark.parametrize("batched", ["sdpa", "kernel", "paged", "triton"],
                         ids=["sdpa-per-row", "cpu-kernel", "paged-decode", "triton-pages"])  # fmt: skip
@pytest.mark.parametrize("lodged", [False, True], ids=["own-buffers", "pool-slots"])
def test_draft_plan_equals_attention_over_view_and_chain(pool, spec: str, batched: str,
                                                        lodged: bool, request) -> None:  # fmt: skip
    """Each row gets what attending over its own compressed view + draft chain gives; a row
    without a state attends over its chain only. The batched CPU kernel reads every view in
    place: a buffer of its own (the chain written after the view leaves the view as it was), or
    its draft row's pool slots and the chain's slots; a quantized body packed. The SDPA path
    copies a quantized body dequantized, and a lodged view gathered from its slots. A paged
    decoder (a GPU's FlashInfer; here its torch reference behind the same plan/run) reads a
    batch whose every view is in pool slots without a packed body as pages of one token,
    planned once per draft forward (per layer where a pyramid's layers differ); Triton's pool
    decoder (a GPU's; here under Triton's interpreter) reads such a batch with its KIVI bodies
    in their pages, planned the same way; any other batch takes the SDPA path."""
    from sglang_vericache.ops.cpu_draft_decode import load_cpu_draft_decode
    from sglang_vericache.ops.dropped_decode import TorchDroppedKVDecoder
    from sglang_vericache.ops.pool_kivi_decode import PoolKiviDecode
    from sglang_vericache.srt.attention.draft_attention import DraftPlan

    plans = []

    class Counted(TorchDroppedKVDecoder):
        def plan(self, *args, **kw) -> None:
            plans.append("paged")
            super().plan(*args, **kw)

    class CountedTriton(PoolKiviDecode):
        def plan(self, *args, **kw) -> None:
            plans.append("triton")
            super().plan(*args, **kw)

    from sglang_vericache.srt.kv.draft_state import RequestDraftState

    compressor = build_compressor(spec)
    states = []
    for n in (T, T // 2):
        queries = [torch.randn(H_Q, 8, D) for _ in range(LAYERS)]
        states.append(RequestDraftState.build(compressor, layer_reader(pool, torch.arange(n)), n,
                                              queries, LAYERS))  # fmt: skip
        states[-1].append(reader(pool), torch.arange(120, 123), [None] * LAYERS)  # a window
    states.append(None)  # rides along
    if lodged:
        _lodge(pool, states[:2])
    before = [[v[0].clone() for v in s.views()] for s in states[:2]]
    kernel = load_cpu_draft_decode() if batched == "kernel" else None
    assert kernel is not None or batched != "kernel", "the CPU draft-attention kernel did not build"
    paged = Counted() if batched == "paged" else None
    pool_kivi = None
    if batched == "triton":
        request.getfixturevalue("triton_interpreted")
        pool_kivi = CountedTriton(torch.device("cpu"))
    plan = DraftPlan([T + 3, T // 2 + 3, 5], states, drafts=3, kernel=kernel, paged=paged,
                     pool_kivi=pool_kivi)  # fmt: skip
    q = torch.randn(3, H_Q, D)
    for n_chain in (1, 2, 3):  # the chain grows by one per draft forward
        chains = [torch.arange(150 + 10 * i, 150 + 10 * i + n_chain) for i in range(3)]
        for layer in range(LAYERS):
            got = plan.attend(q, layer, pool[layer][0], pool[layer][1], chains, 0.25)
            for i, state in enumerate(states):
                want = _reference_draft_attention(q[i], state, pool, layer, chains[i])
                torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    for state, keys in zip(states[:2], before):
        state.check_integrity()
        assert all(torch.equal(k, v[0]) for k, v in zip(keys, state.views()))
    # which drafted rows a pool decoder reads (all lodged ones for Triton; FlashInfer those
    # without a packed body), the others per row
    pooled = [lodged and (batched == "triton" or (batched == "paged" and s.layers[0].block is None))
              for s in states[:2]]  # fmt: skip
    if any(pooled):  # once per forward, again at each layer whose views differ (a pyramid)
        lens = [tuple(s.layers[layer].float_len for s in states[:2]) for layer in range(LAYERS)]
        assert plans == [batched] * 3 * (1 + sum(a != b for a, b in zip(lens, lens[1:])))
    else:
        assert plans == []
    # per row, gathered (lodged) or dequantized (a body): one layer of the batch at a time
    copied = sum(s.view_tokens + 3 for s, read in zip(states[:2], pooled)
                 if not read and (lodged or s.layers[0].block is not None))  # fmt: skip
    assert plan.transient_bytes == (0 if batched == "kernel" else 2 * H_KV * D * 4 * copied)
    if spec.startswith("kivi"):
        assert states[0].layers[0].block is not None, "the longer row must have a packed body"
    for state in states[:2] if lodged else ():
        assert all(cache.draft_slots() is not None for cache in state.layers), "left the pool"
    assert plan.view_tokens[2] == 0 and plan.view_tokens[0] == states[0].view_tokens


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.5", "kivi:bits=4"])
@pytest.mark.parametrize("batched", ["paged", "triton"])
def test_a_batch_partly_in_the_pool_reads_those_rows_with_the_decoder(
        pool, spec: str, batched: str, triton_interpreted: None) -> None:  # fmt: skip
    """A GPU batch mixes rows in the pool with rows beside it (a resident row whose draft row an
    allocation took back): the pool decoder reads the rows it can, as one batch, and the
    others attend one SDPA call each; a decoder that reads no drafted row is not called."""
    from sglang_vericache.ops.dropped_decode import TorchDroppedKVDecoder
    from sglang_vericache.ops.pool_kivi_decode import PoolKiviDecode
    from sglang_vericache.srt.attention.draft_attention import DraftPlan
    from sglang_vericache.srt.kv.draft_state import RequestDraftState

    planned = []

    class Paged(TorchDroppedKVDecoder):
        def plan(self, indptr, *args, **kw) -> None:
            planned.append(int(indptr.numel()) - 1)
            super().plan(indptr, *args, **kw)

    class Triton(PoolKiviDecode):
        def plan(self, columns, *args, **kw) -> None:
            planned.append(len(columns))
            super().plan(columns, *args, **kw)

    queries = [torch.randn(H_Q, 8, D) for _ in range(LAYERS)]
    states = [RequestDraftState.build(build_compressor(spec), layer_reader(pool, torch.arange(T)),
                                      T, queries, LAYERS) for _ in range(2)]  # fmt: skip
    _lodge(pool, states[1:])  # row 0 beside the pool, row 1 in it
    if batched == "triton":
        decoders = {"pool_kivi": Triton(torch.device("cpu"))}
    else:
        decoders = {"paged": Paged()}
    plan = DraftPlan([T + 1, T + 1, 3], [*states, None], drafts=1, **decoders)
    q = torch.randn(3, H_Q, D)
    chains = [torch.arange(150 + 10 * i, 151 + 10 * i) for i in range(3)]
    for layer in range(LAYERS):
        got = plan.attend(q, layer, pool[layer][0], pool[layer][1], chains, 0.25)
        for i, state in enumerate([*states, None]):
            want = _reference_draft_attention(q[i], state, pool, layer, chains[i])
            torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    body = states[1].layers[0].block is not None
    read = not (batched == "paged" and body)  # FlashInfer reads no packed body
    assert planned == ([2] if read else []), "row 1 and the rider, once per forward"
    # per row: row 0 dequantized where it has a body; row 1, if no decoder read it, gathered
    copied = (states[0].view_tokens + 1) * body + (0 if read else states[1].view_tokens + 1)
    assert plan.transient_bytes == 2 * H_KV * D * 4 * copied


def test_a_packed_body_the_kernel_refuses_is_dequantized(pool) -> None:
    """Where the kernel turns a batch down (here: a float64 query) the per-row path reads each
    packed KIVI body dequantized, and attends as the reference does."""
    from sglang_vericache.ops.cpu_draft_decode import load_cpu_draft_decode
    from sglang_vericache.srt.attention.draft_attention import DraftPlan
    from sglang_vericache.srt.kv.draft_state import RequestDraftState

    kernel = load_cpu_draft_decode()
    assert kernel is not None, "the CPU draft-attention kernel did not build"
    state = RequestDraftState.build(build_compressor("kivi:bits=4"),
                                    layer_reader(pool, torch.arange(T)), T,
                                    [None] * LAYERS, LAYERS)  # fmt: skip
    assert state.layers[0].compressed.block is not None
    plan = DraftPlan([T], [state], drafts=1, kernel=kernel)
    q = torch.randn(1, H_Q, D, dtype=torch.float64)
    chain = [torch.arange(200, 201)]
    got = plan.attend(q, 0, pool[0][0], pool[0][1], chain, 0.25)
    want = _reference_draft_attention(q[0].float(), state, pool, 0, chain[0])
    torch.testing.assert_close(got[0].float(), want, rtol=1e-5, atol=1e-5)
