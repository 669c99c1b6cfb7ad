"""layer_skip_agreement.py: wrapped layers change nothing until skipped, a skipped layer is the
identity on the hidden states (a tiny random Llama), and the least harmful layers are ranked."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmark.layer_skip_agreement import SkippableLayer, agreement, least_harmful


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_wrapped_layers_match_the_model_until_skipped() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
    layers = [SkippableLayer(layer) for layer in model.model.layers]
    model.model.layers = nn.ModuleList(layers)
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, before)
    reference = before[0, -6:].argmax(-1)
    assert agreement(model, layers, [], ids, reference, 6) == 1.0
    layers[1].skip = True
    x = torch.randn(1, 12, 32)
    assert layers[1](x) is x
    with torch.no_grad():
        assert not torch.equal(model(ids, use_cache=False).logits, before)


def test_least_harmful_takes_the_layers_that_kept_the_most_agreement() -> None:
    single = {0: 0.2, 1: 0.9, 2: 0.7, 3: 0.9}
    assert least_harmful(single, [1, 2, 3, 8]) == {1: [1], 2: [1, 3], 3: [1, 2, 3]}
