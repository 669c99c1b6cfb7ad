"""Hidden states under ``--vericache``: the same entries per request as plain SGLang.

A request with ``return_hidden_states`` makes its whole decode step plain (``whole_step_reason``
in ``srt/decode/eligibility.py``); that step's one-token output must reach SGLang's spec result path in
the layout it reads (row i's entries at ``i * stride``), for every row of a batch, in both
request modes:

    true    every position: the prompt's (one [T, H] entry), then one [H] per decode step
    "last"  the newest position only (the response holds that one [H] vector)

The shared servers allow both (``--return-hidden-states-mode full``, test/conftest.py). SGLang's
HTTP route takes only booleans, so ``"last"`` goes through ``sglang.Engine`` (its own process,
like test_engine.py) and is checked against the plain server's ``true`` answer: its one entry
is the last one of that.

The prompt's entry holds the positions this request prefilled, which depend on what each
server's prefix cache held already; they are compared where both hold them (the latest).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from sglang_vericache.exactness.server import http_json

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(1800)]

HIDDEN_TOL = 1e-4
NEW_TOKENS = 4
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS}


def prompts(tag: str, n: int) -> list[str]:
    """``n`` prompts of one test (each test its own: a prompt's first entry depends on what the
    prefix cache holds)."""
    topics = ["the sea", "a mountain town", "prime numbers", "an old clock"]
    return [f"Hidden-state check {tag}: write one line about {topics[k]}.\n" for k in range(n)]


def generate_batch(server, texts: list[str], modes: list[Any]) -> list[dict[str, Any]]:
    """One ``/generate`` batch, row k asking ``modes[k]`` (booleans: the HTTP route's)."""
    payload = {"text": texts, "sampling_params": GREEDY, "return_hidden_states": modes}
    out = http_json(server.url + "/generate", payload)
    assert isinstance(out, list) and len(out) == len(modes)
    return out


def assert_close(ref: list, got: list) -> None:
    """Two vectors (or lists of vectors) equal within ``HIDDEN_TOL``."""
    ref_rows, got_rows = (ref, got) if isinstance(ref[0], list) else ([ref], [got])
    assert [len(v) for v in got_rows] == [len(v) for v in ref_rows]
    worst = max(abs(a - b) for r, g in zip(ref_rows, got_rows) for a, b in zip(r, g))
    assert worst <= HIDDEN_TOL, worst


def assert_same_full_hidden_states(ref: dict[str, Any], got: dict[str, Any]) -> None:
    """``true`` mode: as many entries, the prompt's alike where both prefilled a position
    (module doc), the decode steps' alike."""
    assert got["output_ids"] == ref["output_ids"]
    want, have = ref["meta_info"].get("hidden_states"), got["meta_info"].get("hidden_states")
    if want is None:
        assert have is None
        return
    assert have is not None, "no hidden states came back"
    assert len(have) == len(want) == NEW_TOKENS, (len(have), len(want))
    shared = min(len(want[0]), len(have[0]))
    assert shared >= 1
    assert_close(want[0][-shared:], have[0][-shared:])
    for w, h in zip(want[1:], have[1:]):
        assert_close(w, h)


def test_every_row_of_a_batch_gets_its_hidden_states(plain_server, vericache_server) -> None:
    """The reported bug: only row 0 got its decode steps' entries, the others only their
    prompt's."""
    texts = prompts("all rows", 3)
    modes = [True] * len(texts)
    ref = generate_batch(plain_server, texts, modes)
    got = generate_batch(vericache_server, texts, modes)
    for r, g in zip(ref, got):
        assert_same_full_hidden_states(r, g)


def test_a_batch_mixing_rows_with_and_without_hidden_states(plain_server,
                                                            vericache_server) -> None:  # fmt: skip
    texts = prompts("mixed rows", 4)
    modes = [False, True, False, True]
    ref = generate_batch(plain_server, texts, modes)
    got = generate_batch(vericache_server, texts, modes)
    assert [r["meta_info"].get("hidden_states") is None for r in ref] == [True, False, True, False]
    for r, g in zip(ref, got):
        assert_same_full_hidden_states(r, g)
    # no request asks for them any more: steps draft again
    again = generate_batch(vericache_server, prompts("drafted again", 2), [False, False])
    assert all(g["meta_info"]["vericache"]["verify_steps"] >= 1 for g in again), again


ENGINE_SCRIPT = """
import json, sys
import sglang as sgl
from sglang_vericache.srt.engine import vericache_server_args

model, batches = sys.argv[1], json.loads(sys.argv[2])
args = vericache_server_args(model_path=model, max_total_tokens=16384, chunked_prefill_size=512,
                             return_hidden_states_mode="full", vericache_draft_len=4)
engine = sgl.Engine(server_args=args)
try:
    out = {name: engine.generate(texts, [%s] * len(texts), return_hidden_states=modes)
           for name, (texts, modes) in batches.items()}
finally:
    engine.shutdown()
print("RESULT " + json.dumps({name: [{"output_ids": o["output_ids"],
                                      "hidden_states": o["meta_info"].get("hidden_states")}
                                     for o in outs] for name, outs in out.items()}))
""" % json.dumps(GREEDY)


def test_last_mode_through_the_engine(plain_server, default_model_path) -> None:
    """``"last"``: the newest position's vector (the scheduler indexed past the end of a plain
    step's [bs, H] for every row after the first)."""
    batches = {"last": (prompts("last", 3), ["last"] * 3),
               "mixed": (prompts("last mixed", 3), [False, "last", True])}
    # its own process: Engine.shutdown() kills every child of its process (test_engine.py)
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(default_model_path),
                           json.dumps(batches)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    for name, (texts, modes) in batches.items():
        ref = generate_batch(plain_server, texts, [m is not False for m in modes])
        for r, g, mode in zip(ref, got[name], modes):
            assert g["output_ids"] == r["output_ids"]
            want = r["meta_info"].get("hidden_states")
            if mode is False:
                assert g["hidden_states"] is None
            elif mode == "last":
                assert_close(want[-1], g["hidden_states"])
            else:
                assert len(g["hidden_states"]) == len(want) == NEW_TOKENS
                for w, h in zip(want[1:], g["hidden_states"][1:]):
                    assert_close(w, h)
