"""Draft forwards on shadow weights: outside drafting every layer computes what it did before,
bit for bit; inside, the shadow dtype's product; the flag's rules and errors."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.sglang


class TinyCausalLM(nn.Module):
    """Two of SGLang's own linear layers (their ``quant_method`` is SGLang's
    ``UnquantizedLinearMethod``), a tied-style LM head and a logits processor with SGLang's call
    convention. SGLang's ``LogitsProcessor`` needs a ForwardBatch to run; the real one is
    covered end to end (``test/e2e/test_vericache_exactness.py`` drafts on bf16 shadows)."""

    def __init__(self, hidden: int = 32, vocab: int = 50) -> None:
        super().__init__()
        from sglang.srt.layers.linear import ReplicatedLinear

        torch.manual_seed(0)
        self.up = ReplicatedLinear(hidden, 4 * hidden, bias=True, params_dtype=torch.float32)
        self.down = ReplicatedLinear(4 * hidden, hidden, bias=False, params_dtype=torch.float32)
        for layer in (self.up, self.down):
            nn.init.normal_(layer.weight, std=0.2)
        nn.init.normal_(self.up.bias, std=0.2)
        self.lm_head = nn.Embedding(vocab, hidden)
        self.logits_processor = Logits()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.down(torch.relu(self.up(x)[0]))[0]
        return self.logits_processor(None, hidden, self.lm_head, None).next_token_logits


class Logits(nn.Module):
    """SGLang's ``_compute_lm_head`` dispatch: the head's quant method where SGLang's own rule
    applies it (the shadow head relies on that), else a matmul by its weight."""

    def forward(self, input_ids, hidden_states, lm_head, forward_batch, *args):
        from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

        method = getattr(lm_head, "quant_method", None)
        if should_apply_lm_head_quant_method(lm_head, method):
            logits = method.apply(lm_head, hidden_states, None)
        else:
            logits = torch.matmul(hidden_states.to(lm_head.weight.dtype), lm_head.weight.T)
        return SimpleNamespace(next_token_logits=logits)


def bf16():
    from sglang_vericache.srt.attention.draft_precision import ShadowFormat

    return ShadowFormat(torch.bfloat16)


def test_outside_drafting_every_layer_is_bit_identical_and_inside_runs_on_shadows() -> None:
    from sglang_vericache.srt.attention.draft_precision import DraftPrecision, ShadowLinearMethod, drafting

    model = TinyCausalLM()
    x = torch.randn(8, 32)
    before = model(x)
    precision = DraftPrecision(bf16()).install(model)
    assert precision.layers == 3  # up, down and the LM head
    assert isinstance(model.up.quant_method, ShadowLinearMethod)
    expected_bytes = 2 * (32 * 128 + 128 * 32 + 50 * 32 + 128)  # bf16 weights and up's bias
    assert precision.nbytes == expected_bytes

    assert torch.equal(model(x), before)  # not drafting: the model's own weights, bit for bit
    with drafting(precision):
        drafted = model(x)
    assert torch.equal(model(x), before)  # the switch is off again after the draft forwards

    bf = lambda t: t.detach().to(torch.bfloat16)  # noqa: E731
    hidden = torch.nn.functional.linear(x.to(torch.bfloat16), bf(model.up.weight), bf(model.up.bias))
    hidden = torch.nn.functional.linear(torch.relu(hidden.float()).to(torch.bfloat16),
                                        bf(model.down.weight)).float()  # fmt: skip
    shadow_logits = torch.matmul(hidden.to(torch.bfloat16), bf(model.lm_head.weight).T).float()
    assert drafted.dtype == torch.float32  # drafts read logits in the model's dtype
    assert torch.equal(drafted, shadow_logits)
    assert not torch.equal(drafted, before)  # a different precision, really
    assert torch.allclose(drafted, before, rtol=0.02, atol=0.3)  # and close to the model's


def test_a_weight_update_remakes_the_shadows_before_the_next_draft() -> None:
    """SGLang's loaders copy new weights into the model's tensors in place: until the hooks say
    so the shadows still hold the old model; after, the next draft forward runs on shadows of
    the new weights, bit for bit what a precision installed on the new model computes."""
    from sglang_vericache.srt.attention.draft_precision import DraftPrecision, drafting

    model = TinyCausalLM()
    x = torch.randn(8, 32)
    precision = DraftPrecision(bf16()).install(model)
    with drafting(precision):
        old_drafts = model(x)
    nbytes = precision.nbytes
    with torch.no_grad():  # an update from disk: every weight and bias overwritten in place
        for layer in (model.up, model.down):
            layer.weight.copy_(-2.0 * layer.weight)
        model.up.bias.add_(1.0)
        model.lm_head.weight.mul_(0.5)
    with drafting(precision):
        assert torch.equal(model(x), old_drafts)  # stale: nobody said the weights changed
    precision.weights_changed()
    assert precision.stale
    with drafting(precision):
        new_drafts = model(x)
    assert not precision.stale and precision.refreshes == 1 and precision.nbytes == nbytes

    fresh = TinyCausalLM()
    with torch.no_grad():
        for name in ("up", "down"):
            getattr(fresh, name).weight.copy_(getattr(model, name).weight)
        fresh.up.bias.copy_(model.up.bias)
        fresh.lm_head.weight.copy_(model.lm_head.weight)
    reference = DraftPrecision(bf16()).install(fresh)
    with drafting(reference):
        assert torch.equal(new_drafts, fresh(x))
    assert not torch.equal(new_drafts, old_drafts)


def test_drafting_without_shadows_is_a_no_op_and_the_switch_resets_on_error() -> None:
    from sglang_vericache.srt.attention.draft_precision import DraftPrecision, drafting

    with drafting(None):
        pass
    precision = DraftPrecision(bf16())
    with pytest.raises(RuntimeError), drafting(precision):
        assert precision.switch.active
        raise RuntimeError("a draft forward failed")
    assert not precision.switch.active


def test_layers_already_in_the_draft_dtype_are_not_copied() -> None:
    from sglang_vericache.srt.attention.draft_precision import DraftPrecision

    model = TinyCausalLM().to(torch.bfloat16)
    precision = DraftPrecision(bf16()).install(model)
    assert precision.layers == 0 and precision.nbytes == 0  # the LM head neither
    assert type(model.logits_processor).__name__ == "Logits"
    assert type(model.up.quant_method).__name__ == "UnquantizedLinearMethod"


def test_packed_fp16_shadows_compute_in_fp32_over_fp16_rounded_weights() -> None:
    from sglang_vericache.srt.attention.draft_precision import (
        DraftPrecision,
        ShadowFormat,
        drafting,
        packed_fp16_available,
    )

    if not packed_fp16_available(torch.device("cpu")):
        pytest.skip("fbgemm's packed fp16 GEMM is x86 only")

    model = TinyCausalLM()
    x = torch.randn(8, 32)
    before = model(x)
    precision = DraftPrecision(ShadowFormat(torch.float16, packed=True)).install(model)
    assert precision.layers == 3
    assert precision.nbytes == 2 * (32 * 128 + 128 * 32 + 50 * 32) + 4 * 128  # fp16 + fp32 bias
    with drafting(precision):
        drafted = model(x)
    assert torch.equal(model(x), before)  # outside drafting: the model's own weights

    h = lambda t: t.detach().half().float()  # noqa: E731  what the packed weights hold
    hidden = torch.nn.functional.linear(x, h(model.up.weight), model.up.bias.detach())
    hidden = torch.nn.functional.linear(torch.relu(hidden), h(model.down.weight))
    expected = hidden @ h(model.lm_head.weight).T
    assert drafted.dtype == torch.float32
    assert torch.allclose(drafted, expected, rtol=1e-5, atol=1e-5)  # fp32 arithmetic
    assert not torch.equal(drafted, before)  # the weights' rounding is fp16's


def test_choose_draft_format_follows_the_flag_and_the_model_dtype() -> None:
    from sglang_vericache.srt.attention.draft_precision import (
        ShadowFormat,
        choose_draft_format,
        packed_fp16_available,
        shadow_speedup,
    )

    cpu = torch.device("cpu")
    packed = packed_fp16_available(cpu)
    assert choose_draft_format("model", torch.float32, cpu, 64) is None
    assert choose_draft_format("bfloat16", torch.float32, cpu, 64) == ShadowFormat(torch.bfloat16)
    assert choose_draft_format("float16", torch.float32, cpu, 64) == ShadowFormat(torch.float16,
                                                                                 packed)
    assert choose_draft_format("bfloat16", torch.bfloat16, cpu, 64) is None  # nothing to shadow
    assert choose_draft_format("auto", torch.bfloat16, cpu, 64) is None
    auto = choose_draft_format("auto", torch.float32, cpu, 64)
    assert auto in (None, ShadowFormat(torch.bfloat16), ShadowFormat(torch.float16, packed=True))
    assert shadow_speedup(ShadowFormat(torch.bfloat16), torch.float32, cpu, 64) > 0
    with pytest.raises(ValueError, match="packed shadows are float16"):
        ShadowFormat(torch.bfloat16, packed=True)


def test_the_flag_parses_round_trips_and_names_itself_when_wrong() -> None:
    from sglang_vericache.config import VeriCacheConfig, VeriCacheConfigError, add_cli_flags

    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    ns = parser.parse_args(["--vericache", "--vericache-draft-dtype", "model"])
    config = VeriCacheConfig.from_namespace(ns)
    assert config.draft_dtype == "model"
    assert VeriCacheConfig.from_dict(config.to_dict()) == config
    assert VeriCacheConfig.from_namespace(parser.parse_args(["--vericache"])).draft_dtype == "auto"
    with pytest.raises(VeriCacheConfigError, match="--vericache-draft-dtype.*float8"):
        VeriCacheConfig.from_dict({**config.to_dict(), "draft_dtype": "float8"})
    with pytest.raises(SystemExit):  # argparse names the choices at start-up
        parser.parse_args(["--vericache", "--vericache-draft-dtype", "int4"])


@pytest.mark.parametrize("how", ["disk", "failed disk", "tensor", "raising"])
def test_every_weight_update_marks_the_shadows_stale_tier_or_not(how: str) -> None:
    """SGLang's weight-update calls, through the hooks around them (``model_identity.py``): on
    a server without a remote tier (no ``ServedWeights``) the shadows in the scheduler's context
    are marked stale by a disk load, a failed one, an unnamed update and one that raised; a
    draft model's runner leaves them alone."""
    from sglang_vericache.srt.attention.draft_precision import DraftPrecision
    from sglang_vericache.srt.context import open_context
    from sglang_vericache.srt.prefix import model_identity as hooks

    pool = SimpleNamespace()
    precision = DraftPrecision(bf16()).install(TinyCausalLM())
    open_context(pool).draft_precision = precision
    draft_runner = SimpleNamespace(req_to_token_pool=pool, is_draft_worker=True)
    hooks._around_disk_load(lambda *a: (True, "ok"), SimpleNamespace(
        get_model_runner=lambda: draft_runner), "/m", None)  # fmt: skip
    assert not precision.stale
    runner = SimpleNamespace(req_to_token_pool=pool, is_draft_worker=False)
    updater = SimpleNamespace(get_model_runner=lambda: runner)
    manager = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner))

    def broken(*args: object) -> None:
        raise RuntimeError("lost a shard")

    if how == "disk":
        hooks._around_disk_load(lambda *a: (True, "ok"), updater, "/m", None)
    elif how == "failed disk":
        hooks._around_disk_load(lambda *a: (False, "no"), updater, "/m", None)
    elif how == "tensor":
        hooks._around_unnamed_change("update_weights_from_tensor")(lambda *a: None, manager)
    else:
        with pytest.raises(RuntimeError):
            hooks._around_unnamed_change("update_weights_from_tensor")(broken, manager)
    assert precision.stale
