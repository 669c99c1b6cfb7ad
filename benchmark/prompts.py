"""A fixed, offline set of long prompts built from text that ships with Python.

Four kinds, in turn: ``code`` (a stdlib module's source, cut after a line), ``json`` (an agent's
tool-call transcript as JSON whose tool results are stdlib docstrings, cut inside a call),
``prose`` (sections of the Python language reference from ``pydoc_data.topics``, cut mid-
paragraph) and ``multidoc`` (several reference sections as numbered documents, then a question).
The same Python version, tokenizer and seed give the same prompts; nothing is downloaded.

Usage::

    from benchmark.prompts import build_prompt_set, write_jsonl
    prompts = build_prompt_set(tokenizer, n=24, min_tokens=1000, max_tokens=3000, seed=0)
    write_jsonl(prompts, "prompts.jsonl")   # lines of {"id", "kind", "prompt"}

``tokenizer`` is anything with ``encode(text) -> list[int]`` (a transformers tokenizer works).
Command line: ``python benchmark/prompts.py out.jsonl [--n 24 --min-tokens 1000 ...]``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from functools import lru_cache
from typing import Protocol

KINDS = ("code", "json", "prose", "multidoc")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=4)
def _source_files(min_bytes: int) -> tuple[Path, ...]:
    root = _stdlib()
    skip = ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__")
    files = [p for p in root.rglob("*.py")
             if not any(part in skip for part in p.relative_to(root).parts) and p.stat().st_size >= min_bytes]
    return tuple(sorted(files))


def _topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics  # the language reference, shipped with CPython

    return sorted((k, v) for k, v in topics.items() if len(v) > 2000)


def _fill(units: Iterator[str], tok: Tokenizer, target: int, sep: str) -> str:
    """Joins units until about ``target`` tokens (counted per unit; trimmed by the caller)."""
    out: list[str] = []
    count = 0
    for unit in units:
        out.append(unit)
        count += len(tok.encode(unit + sep))
        if count >= target:
            break
    return sep.join(out)


def _code(rng: random.Random, tok: Tokenizer, target: int) -> str:
    path = rng.choice(_source_files(60_000))
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    head = f"# File: Lib/{path.relative_to(_stdlib()).as_posix()}\n"
    return head + _fill(iter(lines), tok, target, "\n") + "\n"


def _docstrings(rng: random.Random) -> list[tuple[str, str, str]]:
    """(module, function, signature + docstring) of stdlib functions, in a shuffled order."""
    out = list(_all_docstrings())
    rng.shuffle(out)
    return out


@lru_cache(maxsize=1)
def _all_docstrings() -> tuple[tuple[str, str, str], ...]:
    out = []
    for path in _source_files(40_000):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and not node.name.startswith("_"):
                args = ", ".join(a.arg for a in node.args.args)
                out.append((path.stem, node.name, f"def {node.name}({args}):\n{ast.get_docstring(node)}"))
    return tuple(out)


def _json(rng: random.Random, tok: Tokenizer, target: int) -> str:
    docs = _docstrings(rng)
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent. Call tools to look up Python APIs."},
        {"role": "user", "content": "Survey the standard-library helpers we could reuse and summarise each."},
    ]
    count = len(tok.encode(json.dumps(messages, indent=2)))
    for i, (module, name, doc) in enumerate(docs):
        call_id = f"call_{i:03d}"
        messages.append({"role": "assistant", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "lookup_doc", "arguments": json.dumps({"module": module, "name": name})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": doc[:min(1500, target // 2)]})
        count += len(tok.encode(json.dumps(messages[-2:], indent=2)))
        if count >= target:
            break
    text = json.dumps(messages, indent=2)
    # End by opening the next call: the model must continue the JSON structure.
    return text[: text.rfind("\n]")] + ',\n  {\n    "role": "assistant",\n    "tool_calls": [\n'


def _prose(rng: random.Random, tok: Tokenizer, target: int) -> str:
    topics = _topics()
    start = rng.randrange(len(topics))
    paras = (p for _, body in topics[start:] + topics[:start] for p in body.split("\n\n") if p.strip())
    text = _fill(paras, tok, target, "\n\n")
    return text[: text.rfind(" ", 0, len(text) - 40)]  # stop mid-sentence


def _multidoc(rng: random.Random, tok: Tokenizer, target: int) -> str:
    topics = _topics()
    picked = rng.sample(topics, 8)
    per_doc = max(100, target // len(picked))
    docs = []
    for i, (title, body) in enumerate(picked, 1):
        paras = iter(p for p in body.split("\n\n") if p.strip())
        docs.append(f"Document {i} ({title}):\n" + _fill(paras, tok, per_doc, "\n\n"))
    a, b = picked[0][0], picked[-1][0]
    question = (f"\n\nQuestion: Using Documents 1 and {len(picked)}, explain how '{a}' and '{b}' "
                f"differ, quoting the relevant rules.\nAnswer:")
    return "\n\n".join(docs) + question


_BUILDERS: dict[str, Callable[[random.Random, Tokenizer, int], str]] = {
    "code": _code, "json": _json, "prose": _prose, "multidoc": _multidoc,
}


def _trim(text: str, tok: Tokenizer, max_tokens: int, kind: str) -> str:
    """Drops leading lines/paragraphs (keeps the ending, where the continuation starts)."""
    sep = "\n\n" if kind in ("prose",) else "\n"
    while (count := len(tok.encode(text))) > max_tokens:
        # Drop about the excess (by its share of characters), up to the next separator.
        drop = max(1, int(len(text) * (count - max_tokens) / count))
        cut = text.find(sep, drop)
        text = text[cut + len(sep):] if 0 < cut < len(text) // 2 + drop else text[drop:]
    return text


def build_prompt_set(tokenizer: Tokenizer, n: int = 24, min_tokens: int = 1000, max_tokens: int = 3000,
                     seed: int = 0) -> list[dict]:
    """``n`` prompts of [min_tokens, max_tokens] tokens, kinds in turn code/json/prose/multidoc.

    Returns [{"id": "code-00", "kind": "code", "text": ...}, ...] in a fixed order.
    """
    if not 0 < min_tokens <= max_tokens:
        raise ValueError("need 0 < min_tokens <= max_tokens")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        target = rng.randint(min_tokens, max_tokens)
        sub = random.Random(rng.getrandbits(64))
        for _attempt in range(8):
            text = _trim(_BUILDERS[kind](sub, tokenizer, target), tokenizer, max_tokens, kind)
            if len(tokenizer.encode(text)) >= min_tokens:
                break
        else:
            raise RuntimeError(f"could not build a {kind} prompt of >= {min_tokens} tokens")
        out.append({"id": f"{kind}-{i:02d}", "kind": kind, "text": text})
    return out


def prompt_set_digest(prompts: list[dict]) -> str:
    """sha256 over ids and texts: identifies a prompt set in results."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(p["id"].encode() + b"\0" + p["text"].encode() + b"\0")
    return h.hexdigest()


def write_jsonl(prompts: list[dict], path: str | Path) -> Path:
    """Writes lines of {"id", "kind", "prompt"}; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"id": p["id"], "kind": p["kind"], "prompt": p["text"]}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output .jsonl")
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--min-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="tokenizer directory (default: the embedded SmolLM2)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    if args.model is None:
        from sglang_vericache.models import ensure_default_model

        args.model = str(ensure_default_model())
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = build_prompt_set(tok, args.n, args.min_tokens, args.max_tokens, args.seed)
    print(write_jsonl(prompts, args.out), prompt_set_digest(prompts))


if __name__ == "__main__":
    main()
