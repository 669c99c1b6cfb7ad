#!/usr/bin/env python3
"""Generate multi-turn agent sessions (JSONL) for prefix-cache experiments, offline.

Each session is what a coding agent sends an OpenAI-compatible server: a long system
prompt (instructions + the tool schemas as JSON + project notes), then turns. Each turn
appends new messages (the task, then tool results: stdlib source files, directory listings
as JSON, grep hits, test reports) and asks for the assistant's answer. The replay client
(``replay_agentic.py``) appends the server's answer to the history, so turn k+1's prompt is
turn k's prompt + answer + the new messages: with ``--reuse 0.9`` the new messages are sized
so that about 90% of each turn's prompt (in tokens) is the previous turn's prompt + answer.

Sizes are in tokens: estimated with a GPT-2-style pre-tokenizer count (within ~10% of
SmolLM2's BPE on this text), or exact with ``--tokenizer path/to/tokenizer.json`` (needs the
``tokenizers`` package). All text comes from the Python standard library installed here
(module sources and docstrings), so nothing is downloaded; output is deterministic for a
given seed, Python build and token counter (both recorded in every line).

    python scripts/agentic_workload.py --sessions 8 --turns 5 --seed 0 -o sessions.jsonl

Line format (one session per line):
    {"format": "vericache-agentic/1", "session_id", "seed", "python", "token_counter",
     "tools": [OpenAI tool schemas], "messages": [the system message],
     "turns": [{"kind": "task"|"tool_result"|"followup", "append": [messages],
                "tokens": int, "target_reuse": float}]}
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import json
import os
import random
import re
import sys
from pathlib import Path
from typing import Callable

FORMAT = "vericache-agentic/1"

# Pure-Python stdlib modules (a fixed list keeps the choice deterministic across installs).
SOURCE_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "colorsys", "configparser", "copy",
    "csv", "dataclasses", "difflib", "enum", "filecmp", "fnmatch", "fractions", "functools",
    "gettext", "glob", "heapq", "hmac", "inspect", "ipaddress", "json.decoder",
    "json.encoder", "keyword", "linecache", "locale", "logging", "mimetypes", "netrc",
    "numbers", "operator", "optparse", "pathlib", "pprint", "queue", "quopri", "random",
    "sched", "secrets", "selectors", "shlex", "shutil", "statistics", "string", "tabnanny",
    "tempfile", "textwrap", "tokenize", "tomllib._parser", "trace", "traceback", "types",
    "typing", "uuid", "warnings", "weakref", "zipfile",
)

TOOLS = [
    ("read_file", "Read a text file of the repository and return its contents.",
     {"path": ("string", "Path relative to the repository root."),
      "start_line": ("integer", "First line to return (1-based)."),
      "end_line": ("integer", "Last line to return (inclusive).")}, ["path"]),
    ("list_dir", "List the entries of a directory with their sizes in bytes.",
     {"path": ("string", "Directory relative to the repository root."),
      "recursive": ("boolean", "Descend into subdirectories.")}, ["path"]),
    ("search_code", "Search the repository for a regular expression; returns file:line hits.",
     {"pattern": ("string", "Python regular expression."),
      "glob": ("string", "Only search files matching this glob, e.g. '*.py'."),
      "max_hits": ("integer", "Stop after this many hits.")}, ["pattern"]),
    ("run_tests", "Run the test suite (or a subset) and return a JSON report.",
     {"selector": ("string", "pytest node id or -k expression."),
      "timeout_s": ("integer", "Abort after this many seconds.")}, []),
    ("apply_patch", "Apply a unified diff to the working tree; returns the files changed.",
     {"diff": ("string", "The unified diff."),
      "check_only": ("boolean", "Only check that the diff applies.")}, ["diff"]),
    ("python_eval", "Evaluate a short Python expression in a sandbox and return its repr.",
     {"expression": ("string", "The expression."),
      "timeout_s": ("integer", "Abort after this many seconds.")}, ["expression"]),
]

USER_TASKS = (
    "The function `{func}` in `{path}` is hard to follow. Explain what it does, then propose "
    "a smaller version with the same behaviour.",
    "A user reports a bug near `{func}` in `{path}`: edge cases with empty input behave "
    "differently than documented. Find the cause and suggest a fix with a test.",
    "Add type hints to `{func}` in `{path}` and list every caller that needs updating.",
    "Write a docstring for `{func}` in `{path}` in the project's style and point out any "
    "behaviour the current comments get wrong.",
    "We want to speed up `{func}` in `{path}`. Measure where the time goes and propose a "
    "change; keep the public interface.",
)

FOLLOWUPS = (
    "Good. Now check the other functions in `{path}` for the same problem.",
    "Before changing anything, show me the exact lines you would edit and why.",
    "The tests you proposed are too broad. Narrow them to `{func}` and its callers.",
    "Summarise what we learned so far in five bullet points, then continue.",
)


# GPT-2-style pre-tokens: each is at least one BPE token; digits count one each.
_PRETOKEN = re.compile(r" ?[A-Za-z]+|\d| ?[^\s\w]+|\s+(?!\S)|\s+")

TokenCounter = Callable[[str], int]


def heuristic_tokens(text: str) -> int:
    return len(_PRETOKEN.findall(text))


def make_counter(tokenizer: str | None) -> tuple[TokenCounter, str]:
    """(counter, description). ``tokenizer``: a tokenizer.json for exact counts."""
    if tokenizer is None:
        return heuristic_tokens, "heuristic-pretokens"
    from tokenizers import Tokenizer  # optional dependency, only for exact sizing

    tok = Tokenizer.from_file(tokenizer)
    return (lambda text: len(tok.encode(text, add_special_tokens=False).ids)), \
        f"tokenizer:{Path(tokenizer).name}"


def fit_tokens(build: Callable[[int], str], target: int, count: TokenCounter) -> str:
    """``build(chars)`` sized so that its token count is close to ``target`` (a few
    deterministic rescaling rounds; ``build`` must be deterministic in ``chars``)."""
    chars = max(1, target * 3)
    text = build(chars)
    for _ in range(4):
        n = count(text)
        if n == 0 or abs(n - target) <= 0.03 * target:
            break
        chars = max(1, round(chars * target / n))
        text = build(chars)
    return text


@functools.lru_cache(maxsize=None)
def load_sources() -> tuple[tuple[str, str], ...]:
    """(path, source) of every available module in ``SOURCE_MODULES``."""
    return tuple(s for s in (module_source(m) for m in SOURCE_MODULES) if s is not None)


def module_source(name: str) -> tuple[str, str] | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    path = Path(spec.origin)
    rel = name.replace(".", "/") + (".py" if path.name != "__init__.py" else "/__init__.py")
    return "lib/" + rel, path.read_text(encoding="utf-8", errors="replace")


@functools.lru_cache(maxsize=None)
def function_names(source: str) -> tuple[str, ...]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    return tuple(sorted({n.name for n in ast.walk(tree)
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}))


def tool_schemas() -> list[dict]:
    out = []
    for name, desc, params, required in TOOLS:
        props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
        out.append({"type": "function", "function": {
            "name": name, "description": desc,
            "parameters": {"type": "object", "properties": props, "required": required}}})
    return out


def system_prompt(rng: random.Random, sources: list[tuple[str, str]], tools: list[dict],
                  chars: int) -> str:
    head = (
        "You are a careful software engineering agent working in a Python repository. "
        "You plan before acting, call one tool at a time by writing a JSON object "
        '{"tool": NAME, "arguments": {...}} on its own line, read tool results carefully, '
        "and never invent file contents. Keep answers short and precise.\n\n"
        "## Tools\n```json\n" + json.dumps(tools, indent=1, sort_keys=True) + "\n```\n\n"
        "## Project notes\n"
    )
    parts = [head]
    size = len(head)
    for path, src in rng.sample(sources, len(sources)):
        doc = _docstring(src)
        if not doc:
            continue
        note = f"### {path}\n{doc.strip()}\n\n"
        parts.append(note[: max(0, chars - size)])
        size += len(parts[-1])
        if size >= chars:
            break
    return "".join(parts)


@functools.lru_cache(maxsize=None)
def _docstring(source: str) -> str | None:
    try:
        return ast.get_docstring(ast.parse(source))
    except SyntaxError:
        return None


@functools.lru_cache(maxsize=None)
def _stdlib_listing() -> tuple[dict, ...]:
    stdlib = os.path.dirname(os.__file__)
    entries = []
    for name in sorted(os.listdir(stdlib)):
        full = os.path.join(stdlib, name)
        entries.append({"name": name, "dir": os.path.isdir(full),
                        "bytes": os.path.getsize(full) if os.path.isfile(full) else None})
    return tuple(entries)


def _fit(text: str, chars: int) -> str:
    """Cut ``text`` to about ``chars`` characters at a line boundary (at least one line)."""
    if len(text) <= chars:
        return text
    cut = text.rfind("\n", 0, chars)
    return text[: cut if cut > 0 else chars]


@functools.lru_cache(maxsize=None)
def _lines(source: str) -> tuple[str, ...]:
    return tuple(source.splitlines())


def tool_result(rng: random.Random, sources: list[tuple[str, str]], chars: int) -> str:
    kind = rng.choice(("read_file", "read_file", "list_dir", "search_code", "run_tests"))
    path, src = rng.choice(sources)
    if kind == "read_file":
        lines = _lines(src)
        start = rng.randrange(max(1, len(lines) - 20))
        numbered = "\n".join(f"{i + 1:5d}  {ln}" for i, ln in enumerate(lines[start:], start))
        call = {"tool": "read_file", "arguments": {"path": path, "start_line": start + 1}}
        body = _fit(numbered, chars)
    elif kind == "list_dir":
        entries = _stdlib_listing()
        start = rng.randrange(max(1, len(entries) - 10))
        call = {"tool": "list_dir", "arguments": {"path": "lib"}}
        body = _fit(json.dumps(list(entries[start:]), indent=1), chars)
    elif kind == "search_code":
        word = rng.choice(function_names(src) or ("return",))
        hits = [f"{p}:{i + 1}: {ln.strip()}" for p, s in sources
                for i, ln in enumerate(_lines(s)) if word in ln]
        call = {"tool": "search_code", "arguments": {"pattern": word, "glob": "*.py"}}
        body = _fit("\n".join(hits) or "(no hits)", chars)
    else:
        names = function_names(src) or ("main",)
        cases: list[dict] = []
        size = 0
        while size < chars and len(cases) < 2000:
            size += 90  # about one indented case in the JSON below
            cases.append({"nodeid": f"tests/test_{Path(path).stem}.py::test_"
                                    f"{rng.choice(names)}_{len(cases)}",
                          "outcome": rng.choices(["passed", "failed", "skipped"], [90, 7, 3])[0],
                          "duration_s": round(rng.uniform(0.001, 2.5), 3)})
        call = {"tool": "run_tests", "arguments": {"selector": f"tests/test_{Path(path).stem}.py"}}
        body = _fit(json.dumps({"summary": {o: sum(c["outcome"] == o for c in cases)
                                            for o in ("passed", "failed", "skipped")},
                                "tests": cases}, indent=1), chars)
    return f"Tool call: {json.dumps(call)}\nResult:\n```\n{body}\n```"


def tool_results(rng: random.Random, sources: list[tuple[str, str]], chars: int) -> str:
    """One or more tool results (the agent called several tools) totalling about ``chars``."""
    parts = [tool_result(rng, sources, chars)]
    total = len(parts[0])
    while total < 0.9 * chars:
        parts.append(tool_result(rng, sources, chars - total))
        total += len(parts[-1]) + 2
    return "\n\n".join(parts)


def make_session(index: int, seed: int, args: argparse.Namespace,
                 sources: list[tuple[str, str]], tools: list[dict], system: str,
                 count: TokenCounter) -> dict:
    rng = random.Random(f"{seed}/{index}")
    if not args.shared_system:
        system = fit_tokens(lambda c: system_prompt(random.Random(f"{seed}/{index}/system"),
                                                    sources, tools, c),
                            args.system_tokens, count)
    history = count(system)  # tokens of the conversation so far (+ estimated answers)
    turns = []
    path, src = rng.choice(sources)
    func = rng.choice(function_names(src) or ("main",))
    for k in range(args.turns):
        # new content sized so that (previous prompt + answer) / prompt ~= reuse
        target = max(args.min_turn_tokens, round(history * (1 - args.reuse) / args.reuse))
        turn_seed = f"{seed}/{index}/turn{k}"
        pick = random.Random(turn_seed)
        if k == 0:
            kind, lead = "task", rng.choice(USER_TASKS).format(func=func, path=path)
            lead += "\n\nContext:\n"
        elif pick.random() < args.followup_prob:
            kind, lead = "followup", pick.choice(FOLLOWUPS).format(func=func, path=path) + "\n\n"
        else:
            kind, lead = "tool_result", ""

        def build(chars: int, lead: str = lead, turn_seed: str = turn_seed) -> str:
            body_rng = random.Random(turn_seed + "/body")
            return lead + tool_results(body_rng, sources, max(0, chars - len(lead)))

        text = fit_tokens(build, target, count)
        n = count(text)
        turns.append({"kind": kind, "append": [{"role": "user", "content": text}],
                      "tokens": n,
                      "target_reuse": round(history / (history + n), 3) if k else 0.0})
        history += n + args.answer_tokens
    return {"format": FORMAT, "session_id": f"s{index:04d}", "seed": seed,
            "python": sys.version.split()[0], "token_counter": args.counter_name,
            "tools": tools, "messages": [{"role": "system", "content": system}],
            "turns": turns}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", type=float, default=0.9,
                   help="target fraction of each turn's prompt that is the previous prompt+answer")
    p.add_argument("--system-tokens", type=int, default=1500,
                   help="system prompt size (at least the instructions + tool schemas, ~900)")
    p.add_argument("--answer-tokens", type=int, default=64,
                   help="expected answer size (the replay's --max-tokens); sizes the next turn")
    p.add_argument("--min-turn-tokens", type=int, default=50)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json for exact token counts (default: a heuristic)")
    p.add_argument("--followup-prob", type=float, default=0.3)
    p.add_argument("--shared-system", action=argparse.BooleanOptionalAction, default=True,
                   help="one system prompt for all sessions (an agent fleet) or one each")
    p.add_argument("-o", "--output", default="-", help="JSONL path, '-' for stdout")
    args = p.parse_args(argv)
    if not 0 < args.reuse < 1:
        p.error("--reuse must be in (0, 1)")
    if args.sessions < 1 or args.turns < 1 or args.system_tokens < 0:
        p.error("--sessions/--turns must be >= 1 and --system-tokens >= 0")
    count, args.counter_name = make_counter(args.tokenizer)

    sources = list(load_sources())
    tools = tool_schemas()
    system = fit_tokens(lambda c: system_prompt(random.Random(f"{args.seed}/system"),
                                                sources, tools, c),
                        args.system_tokens, count)
    out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    reuse: list[float] = []
    try:
        for i in range(args.sessions):
            session = make_session(i, args.seed, args, sources, tools, system, count)
            reuse += [t["target_reuse"] for t in session["turns"][1:]]
            out.write(json.dumps(session, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    mean = f"{sum(reuse) / len(reuse):.3f}" if reuse else "n/a"
    print(f"{args.sessions} sessions x {args.turns} turns, system prompt {count(system)} "
          f"tokens ({args.counter_name}), expected reuse after turn 0: {mean} "
          f"(answers of ~{args.answer_tokens} tokens)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
