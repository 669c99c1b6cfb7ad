"""Which KV a server files in (and takes from) a shared tier: the weights it serves now, and
tokens that are the request's real content.

One zmq KV server is shared by three ``--vericache --vericache-tier zmq://`` servers started
from the embedded model: A and B (prefix cache on, module-scoped), and E
(``--disable-radix-cache``, which SGLang requires for ``input_embeds``; it lives for its one
test only, so at most three servers run at once with the shared plain one). Weight updates go
through SGLang's own ``/update_weights_from_disk`` to a perturbed copy of the model written to
a temporary directory; the reference output for those weights is the shared plain server's,
updated to them for the comparison and back afterwards.

The tests run in file order: the ``input_embeds`` test needs B still on the weights it started
with (the identity E's keys would have).
"""

from __future__ import annotations

import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sglang_vericache.exactness.server import SGLangServer, http_json

from testkit.tier_server import ServerProcess

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(2400)]

CHUNK = 128  # srt/prefix/radix_cache.py REMOTE_CHUNK_TOKENS
NEW_TOKENS = 8
PERTURBED = ".mlp.up_proj.weight"  # every layer's, negated: another model, same shapes


@pytest.fixture(scope="module")
def kv_server() -> Iterator[ServerProcess]:
    with ServerProcess(capacity_gb=1.0) as proc:
        yield proc


@pytest.fixture(scope="module")
def perturbed_model(default_model_path: Path, tmp_path_factory) -> Path:
    """A copy of the embedded model with every layer's MLP up projection negated (tokenizer and
    config equal). Milder changes (one MLP matrix or every attention output halved) left the
    greedy tokens of these repetitive prompts as they were."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed") / "model"
    out.mkdir()
    for item in default_model_path.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy(item, out / item.name)
    tensors = load_file(default_model_path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(PERTURBED)]:
        tensors[name] = -tensors[name]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _tier_args(kv_server: ServerProcess, draft_dtype: str = "model") -> list[str]:
    # B and E: no draft weight copies (256 MiB less per server)
    return ["--max-total-tokens", "4096", "--vericache", "--vericache-draft-len", "4",
            "--vericache-draft-dtype", draft_dtype, "--vericache-tier", kv_server.spec]  # fmt: skip


@pytest.fixture(scope="module")
def server_a(kv_server, tmp_path_factory) -> Iterator[SGLangServer]:
    """Drafts on bf16 shadow weights from the model's compressed KV (no prompt lookup): after
    a weight update its drafts come from shadows of the new weights."""
    log = tmp_path_factory.mktemp("tier_identity_a") / "server.log"
    args = [*_tier_args(kv_server, "bfloat16"), "--vericache-proposer", "compressed"]
    with SGLangServer(args, log_path=log) as a:
        yield a


@pytest.fixture(scope="module")
def server_b(kv_server, tmp_path_factory) -> Iterator[SGLangServer]:
    log = tmp_path_factory.mktemp("tier_identity_b") / "server.log"
    with SGLangServer(_tier_args(kv_server), log_path=log) as b:
        yield b


@pytest.fixture
def embeds_server(kv_server, tmp_path_factory) -> Iterator[SGLangServer]:
    log = tmp_path_factory.mktemp("tier_embeds") / "server.log"
    # bfloat16: SGLang 0.5.23 feeds input_embeds to the model as bfloat16, which a float32
    # model cannot take (such servers refuse them: sglang_vericache/requests_check.py)
    args = [*_tier_args(kv_server), "--disable-radix-cache", "--dtype", "bfloat16"]
    with SGLangServer(args, log_path=log) as e:
        yield e


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


def _prompt(tokenizer, topic: str, n: int = 3 * CHUNK + 20) -> list[int]:
    text = " ".join(f"Clause {i} of the {topic} contract: each {topic} delivery is signed for "
                    "by two people and logged the same day." for i in range(40))  # fmt: skip
    return tokenizer.encode(text)[:n]


def _generate(server: SGLangServer, body: dict, new_tokens: int = NEW_TOKENS, **params) -> dict:
    params = {"temperature": 0, "max_new_tokens": new_tokens, **params}
    return http_json(server.url + "/generate", {**body, "sampling_params": params})


def _update(server: SGLangServer, path: Path, **extra) -> dict:
    """``/update_weights_from_disk``; returns SGLang's answer (HTTP 400 bodies too)."""
    import json
    import urllib.error

    try:
        return http_json(server.url + "/update_weights_from_disk",
                         {"model_path": str(path), **extra})  # fmt: skip
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


@contextmanager
def _plain_on(plain_server: SGLangServer, path: Path, home: Path) -> Iterator[SGLangServer]:
    """The shared plain server serving ``path`` for a while, then ``home`` again."""
    assert _update(plain_server, path)["success"]
    try:
        yield plain_server
    finally:
        assert _update(plain_server, home)["success"]


def _stream(server: SGLangServer, ids: list[int], new_tokens: int, decoding: threading.Event,
            out: dict) -> None:
    """A streamed greedy request: ``decoding`` is set at its second streamed chunk (prefill
    done, decoding), ``out`` gets its last chunk."""
    import json

    body = {"input_ids": ids, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}  # fmt: skip
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    chunks = 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            text = line.decode().strip()
            if not text.startswith("data:") or text == "data: [DONE]":
                continue
            out.clear()
            out.update(json.loads(text[len("data:"):]))
            chunks += 1
            if chunks >= 2:
                decoding.set()
    decoding.set()  # finished (the caller sees whether it spanned anything)


def _wait_puts(kv_server: ServerProcess, at_least: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while kv_server.stats()["puts"] < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return kv_server.stats()["puts"]


def _settled_puts(kv_server: ServerProcess, quiet_s: float = 2.0) -> int:
    """The KV server's put count once nothing more arrived for ``quiet_s``."""
    last = kv_server.stats()["puts"]
    while True:
        time.sleep(quiet_s)
        now = kv_server.stats()["puts"]
        if now == last:
            return now
        last = now


def test_input_embeds_kv_is_never_filed_under_placeholder_tokens(
    server_b, embeds_server, kv_server, plain_server, default_model_path
) -> None:
    """SGLang gives an ``input_embeds`` request placeholder ids (token 1 repeated): its KV must
    not reach the tier under them, where another server would take it for a prompt that
    really is token 1 repeated."""
    from safetensors import safe_open

    b = server_b
    n = 3 * CHUNK
    with safe_open(default_model_path / "model.safetensors", "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    # rows of real tokens (not token 1): KV unlike that of token 1 repeated
    embeds = table[1000 : 1000 + n].tolist()
    before = _settled_puts(kv_server)
    got = _generate(embeds_server, {"input_embeds": embeds})
    assert len(got["output_ids"]) == NEW_TOKENS
    assert _settled_puts(kv_server) == before, "input_embeds KV was written to the tier"
    ones = [1] * (n + 5)
    on_b = _generate(b, {"input_ids": ones})
    assert on_b["meta_info"]["cached_tokens"] == 0, on_b["meta_info"]
    assert on_b["output_ids"] == _generate(plain_server, {"input_ids": ones})["output_ids"]


def test_servers_share_kv_exactly_when_they_serve_the_same_weights(
    server_a, server_b, kv_server, plain_server, tokenizer, perturbed_model, default_model_path
) -> None:
    """A and B start alike; A updates to the perturbed weights, B reloads its own: no KV
    crosses between them. Then B updates to the perturbed weights too: A's KV is a hit on B.
    Every output equals the plain server's on the same weights."""
    a, b = server_a, server_b
    assert _update(a, perturbed_model)["success"]
    assert _update(b, default_model_path)["success"]
    ids = _prompt(tokenizer, "freight")
    whole = len(ids) // CHUNK * CHUNK
    with _plain_on(plain_server, perturbed_model, default_model_path) as plain:
        want_perturbed = _generate(plain, {"input_ids": ids})["output_ids"]
    want_original = _generate(plain_server, {"input_ids": ids})["output_ids"]
    assert want_perturbed != want_original, "the perturbation should change this output"

    before = kv_server.stats()["puts"]
    on_a = _generate(a, {"input_ids": ids})
    assert on_a["output_ids"] == want_perturbed
    # its drafts ran on shadows remade from the perturbed weights, not the start's
    assert on_a["meta_info"]["vericache"]["verify_steps"] >= 1, on_a["meta_info"]
    assert "draft shadow weights remade" in a.log_path.read_text(errors="replace")
    assert _wait_puts(kv_server, before + whole // CHUNK) >= before + whole // CHUNK

    on_b = _generate(b, {"input_ids": ids})
    assert on_b["meta_info"]["cached_tokens"] == 0, on_b["meta_info"]
    assert on_b["output_ids"] == want_original

    assert _update(b, perturbed_model)["success"]
    again = _generate(b, {"input_ids": ids})
    assert again["meta_info"]["cached_tokens"] >= whole, again["meta_info"]
    assert again["output_ids"] == want_perturbed


def test_kv_computed_before_an_in_place_update_is_not_filed_under_the_new_weights(
    server_a, kv_server, tokenizer, perturbed_model, default_model_path
) -> None:
    """``pause_generation(mode="in_place")`` keeps a running request and its KV across a
    weight update (SGLang then cannot flush its cache): that KV was computed by the old
    weights and must not be written through under the new weights' identity, nor may the
    prefix cache's old KV be; once the cache is flushed, writing through resumes. (The
    prompt's whole chunks are written as its prefill completes, under the weights that
    computed them: those land before the update and are the only puts.)"""
    a = server_a
    assert _update(a, perturbed_model)["success"]  # idle: an update SGLang flushes after
    ids = _prompt(tokenizer, "orchard")
    out: dict = {}
    decoding = threading.Event()
    start = _settled_puts(kv_server)
    thread = threading.Thread(target=_stream, args=(a, ids, 240, decoding, out))
    thread.start()
    assert decoding.wait(timeout=600), "the request never started"
    prompt_chunks = len(ids) // CHUNK
    before = _wait_puts(kv_server, start + prompt_chunks)  # under the old (perturbed) identity
    assert before == start + prompt_chunks, (start, before)
    http_json(a.url + "/pause_generation", {"mode": "in_place"})
    try:
        answer = _update(a, default_model_path)
        assert thread.is_alive(), "the request should span the update"
    finally:
        http_json(a.url + "/continue_generation", {})
    assert "not flushed" in answer["message"], answer  # SGLang kept the old KV
    thread.join(timeout=600)
    assert out["meta_info"]["completion_tokens"] == 240, out.get("meta_info")
    assert _settled_puts(kv_server) == before, "old-weight KV written under the new identity"
    # a new request on the unflushed cache: its prompt's first chunks are the old KV
    _generate(a, {"input_ids": ids + tokenizer.encode(" Summary:")})
    assert _settled_puts(kv_server) == before, "old-weight KV written under the new identity"
    with urllib.request.urlopen(a.url + "/flush_cache", timeout=60) as resp:  # plain text
        assert resp.status == 200
    _generate(a, {"input_ids": ids})
    assert _wait_puts(kv_server, before + 1) > before, "a flushed cache writes through again"
