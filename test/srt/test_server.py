"""Plain SGLang on CPU serving the embedded default model (started without --model-path)."""

from __future__ import annotations

import pytest

from sglang_vericache.exactness.server import http_json

pytestmark = [pytest.mark.sglang, pytest.mark.model]


def test_generate_answers_greedily_and_reproducibly(plain_server) -> None:
    body = {
        "text": "def fibonacci(n):\n",
        "sampling_params": {"temperature": 0, "max_new_tokens": 24},
    }
    first = http_json(plain_server.url + "/generate", body)
    second = http_json(plain_server.url + "/generate", body)
    assert first["meta_info"]["completion_tokens"] == 24
    assert first["output_ids"] == second["output_ids"]
    assert second["meta_info"]["cached_tokens"] > 0  # radix-cache hit, same tokens


def test_chat_completion_knows_the_capital_of_france(plain_server) -> None:
    out = http_json(
        plain_server.url + "/v1/chat/completions",
        {
            "model": "default",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 32,
        },
    )
    text = out["choices"][0]["message"]["content"]
    assert "Paris" in text, text


def test_served_model_is_the_embedded_default(plain_server) -> None:
    info = http_json(plain_server.url + "/model_info")
    assert "SmolLM2-135M-Instruct" in info["model_path"]
