"""The exactness harness reuses a saved reference only for the same prompts, args and sampling."""

from __future__ import annotations

import argparse
from pathlib import Path

from sglang_vericache.exactness.__main__ import cached_reference, reference_key
from sglang_vericache.exactness.client import Prompt
from sglang_vericache.exactness.compare import Generation


def _opts(**kw) -> argparse.Namespace:
    base = dict(max_new_tokens=8, temperature=0.0, concurrency=1)
    return argparse.Namespace(**{**base, **kw})


def test_reference_is_reused_only_for_the_same_key(tmp_path: Path) -> None:
    prompts = [Prompt(id="a", text="hello"), Prompt(id="b", input_ids=(1, 2, 3))]
    calls = []

    def run():
        calls.append(1)
        return [Generation((5, 6), (((-0.1, 5), (-2.0, 7)),)), Generation((9,))], 1.5

    path = tmp_path / "ref.json"
    key = reference_key(prompts, ["--max-total-tokens", "4096"], _opts())
    first = cached_reference(path, key, run)
    again = cached_reference(path, key, run)
    assert len(calls) == 1 and again == first  # round-trips exactly, top-2 included
    for changed in (reference_key(prompts[:1], ["--max-total-tokens", "4096"], _opts()),
                    reference_key(prompts, ["--max-total-tokens", "8192"], _opts()),
                    reference_key(prompts, ["--max-total-tokens", "4096"], _opts(concurrency=8))):
        assert changed != key
    cached_reference(path, reference_key(prompts, [], _opts(max_new_tokens=9)), run)
    assert len(calls) == 2  # stale cache: run again
