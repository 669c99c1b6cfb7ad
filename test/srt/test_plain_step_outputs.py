"""What a plain step hands SGLang's spec result path, read by SGLang's own readers.

A batch holding a request that asks for hidden states decodes plainly (``whole_step_reason``);
its one-token forward's outputs are per row ([bs, ...]), while SGLang reads a spec result's rows
at ``i * stride`` (stride: the verify width). Watermarked rows make the whole step plain too:
SGLang's sampler advances the watermark's state, and only a plain step samples every row there.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang

BS, WIDTH, HIDDEN = 3, 5, 4


def plain_forward_output(hidden: torch.Tensor | None):
    """A one-token decode forward's output as SGLang's target worker returns it."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    logits = LogitsProcessorOutput(next_token_logits=torch.zeros(BS, 7), hidden_states=hidden,
                                   next_token_logprobs=torch.tensor([-0.1, -0.2, -0.3]),
                                   )  # fmt: skip
    return SimpleNamespace(next_token_ids=torch.tensor([11, 12, 13]), logits_output=logits)


@pytest.mark.parametrize("mode", [True, "last"])
def test_every_row_reads_its_own_hidden_state_from_a_plain_step(mode) -> None:
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )

    from sglang_vericache.srt.decode.batch_inputs import one_token_rows

    hidden = torch.arange(BS * HIDDEN, dtype=torch.float32).view(BS, HIDDEN)
    out = plain_forward_output(hidden.clone())
    tokens, accept_lens = one_token_rows(out, WIDTH)
    assert tokens.view(BS, WIDTH)[:, 0].tolist() == [11, 12, 13]
    assert accept_lens.tolist() == [1] * BS
    assert out.logits_output.next_token_logprobs.shape == (BS, 1)
    for i in range(BS):  # as process_batch_result_decode reads a spec result's row i
        req = SimpleNamespace(return_hidden_states=mode, hidden_states=[[0.0]],
                              finished_len=None, output_ids=[1, 2])  # fmt: skip
        SchedulerBatchResultProcessor._append_decode_hidden_states(
            req=req, hidden_states=out.logits_output.hidden_states, start=i * WIDTH,
            accept_len=1)  # fmt: skip
        want = [hidden[i].tolist()] if mode == "last" else [[0.0], hidden[i].tolist()]
        assert req.hidden_states == want


def test_a_plain_step_without_hidden_states_leaves_them_none() -> None:
    from sglang_vericache.srt.decode.batch_inputs import one_token_rows

    out = plain_forward_output(None)
    one_token_rows(out, WIDTH)
    assert out.logits_output.hidden_states is None


def sampled_req(**watermark):
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.7, max_new_tokens=8, **watermark)
    sp.verify(vocab_size=1000)
    return SimpleNamespace(sampling_params=sp, grammar=None, custom_logit_processor=None,
                           return_logprob=False)  # fmt: skip


def test_watermarked_rows_make_the_step_plain() -> None:
    """The rows SGLang's watermark forces (its own per-row decision, as the scheduler builds a
    batch's ``SamplingBatchInfo``) decode the whole step through SGLang's sampler."""
    from sglang.srt.sampling.watermarking.core import build_watermark_batch_config

    from sglang_vericache.srt.decode.eligibility import StepRows, whole_step_reason

    def candidates(reqs: list, default_enabled: bool = False) -> list[bool]:
        return build_watermark_batch_config(reqs, default_key="0x5eed", default_context_window=4,
                                            default_enabled=default_enabled, enforce_all=False,
                                            device="cpu").candidates_host  # fmt: skip

    marked = sampled_req(watermark={"enabled": True})
    plain = sampled_req()
    batch = [plain, marked]
    assert StepRows.of(batch).drafted == [0, 1]  # no watermark on the server
    other = sampled_req()
    assert StepRows.of([plain, other], watermarked=candidates([plain, other])).drafted == [0, 1]
    step = StepRows.of(batch, watermarked=candidates(batch))
    assert step.drafted == [] and step.plain == [0, 1]
    assert "watermark" in whole_step_reason(marked, True)
    # the server's default watermarks requests that carry no watermark config of their own
    assert StepRows.of([plain], watermarked=candidates([plain], True)).drafted == []
    # greedy rows are never watermarked (SGLang forces sampled rows only): they still draft
    greedy = sampled_req(watermark={"enabled": True})
    greedy.sampling_params.top_k = 1
    assert StepRows.of([greedy], watermarked=candidates([greedy])).drafted == [0]


@pytest.mark.model
def test_sglang_refuses_watermarks_under_vericache_at_start_up(default_model_path) -> None:
    """Until SGLang admits a watermark with other speculative algorithms than NGRAM and EAGLE,
    ``--vericache --enable-watermark`` does not start (on a GPU: on a CPU, SGLang refuses any
    watermark first)."""
    from sglang_vericache.srt.engine import vericache_server_args

    args = vericache_server_args(model_path=str(default_model_path), device="cuda",
                                 enable_watermark=True)  # fmt: skip
    args.resolve_once()  # as Engine and launch_server do before checking
    with pytest.raises(ValueError, match="VERICACHE"):
        args.check_server_args()
