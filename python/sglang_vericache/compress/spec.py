"""The ``--vericache-compressor`` spec language and the compressor registry.

Grammar (whitespace ignored)::

    spec  := stage | stage "+" stage            # drop, then quantize
    stage := name [":" key "=" value ("," key "=" value)*]
           | "pyramid(" stage "):beta=..."      # per-layer budgets around a ratio dropper

Examples: ``kivi:bits=4``, ``snapkv:ratio=0.25,window=32``, ``snapkv:ratio=0.5+kivi:bits=4``,
``pyramid(snapkv:ratio=0.25):beta=20+turbo:bits=4``. Omitted keys take their defaults;
``Compressor.spec`` spells every key, and ``build_compressor(c.spec) == c``.
"""

from __future__ import annotations

import dataclasses

from sglang_vericache.compress.base import Compressor
from sglang_vericache.compress.compose import Composed, Full
from sglang_vericache.compress.droppers import H2O, Knorm, SnapKV, StreamingLLM
from sglang_vericache.compress.kivi import KIVI_BITS, Kivi
from sglang_vericache.compress.pyramid import Pyramid
from sglang_vericache.compress.turbo import TURBO_BITS, Turbo

_REGISTRY: dict[str, type[Compressor]] = {
    cls.name: cls for cls in (Full, StreamingLLM, SnapKV, H2O, Knorm, Pyramid, Kivi, Turbo)
}
ALIASES = {"streamingllm": "streaming", "rotate": "turbo", "none": "full"}

_RANGES = {
    "ratio": "(0, 1], kept fraction of tokens",
    "sink": ">= 0 tokens",
    "window": ">= 0 tokens",
    "pool": "odd, >= 1",
    "shared": "true|false",
    "group": ">= 1 tokens",
    "residual": ">= 0 tokens",
    "seed": ">= 0",
    "beta": ">= 1",
}
_BITS = {"kivi": "one of " + "/".join(map(str, KIVI_BITS)), "turbo": "one of " + "/".join(map(str, TURBO_BITS))}


class CompressorSpecError(ValueError):
    """A --vericache-compressor spec that does not parse or validate."""


def available_compressors() -> dict[str, type[Compressor]]:
    """Spec name -> compressor class (aliases not included)."""
    return dict(_REGISTRY)


def _keys(cls: type[Compressor]) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.type in ("int", "float", "bool", "str")]


def describe_keys(name: str) -> str:
    """'key (type, range, default ...)' for every key of compressor ``name``."""
    cls = _REGISTRY[name]
    parts = []
    for f in _keys(cls):
        rng = _BITS.get(name, "") if f.name == "bits" else _RANGES.get(f.name, "")
        parts.append(f"{f.name} ({f.type}{', ' + rng if rng else ''}; default {f.default})")
    if cls is Pyramid:
        parts.insert(0, "(<dropper spec>) the wrapped snapkv/h2o/knorm")
    return ", ".join(parts) if parts else "(no keys)"


def _valid_names() -> str:
    return ", ".join(_REGISTRY) + " (aliases: " + ", ".join(f"{a}={n}" for a, n in ALIASES.items()) + ")"


def _error(spec: str, part: str, problem: str, name: str | None = None) -> CompressorSpecError:
    msg = f"bad compressor spec {spec!r}: {problem} (in {part!r}). Valid compressors: {_valid_names()}."
    if name in _REGISTRY:
        msg += f" Keys of {name}: {describe_keys(name)}."
    msg += " Compose as <dropper>+<quantizer>, e.g. 'snapkv:ratio=0.5+kivi:bits=4'."
    return CompressorSpecError(msg)


def _split_top(text: str, sep: str) -> list[str]:
    """Splits on ``sep`` outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _convert(spec: str, part: str, name: str, field: dataclasses.Field, raw: str) -> object:
    try:
        if field.type == "bool":
            low = raw.lower()
            if low not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return low in ("true", "1")
        if field.type == "int":
            return int(raw)
        if field.type == "float":
            return float(raw)
        return raw
    except ValueError:
        raise _error(spec, part, f"{field.name}={raw!r} is not a valid {field.type}", name) from None


def _parse_stage(spec: str, stage: str) -> Compressor:
    head, inner = stage, None
    if "(" in stage:
        open_at, close_at = stage.index("("), stage.rfind(")")
        if close_at < open_at:
            raise _error(spec, stage, "unbalanced parentheses")
        head = stage[:open_at] + stage[close_at + 1 :]
        inner = stage[open_at + 1 : close_at]
    name, _, kvs = head.partition(":")
    name = ALIASES.get(name.lower(), name.lower())
    if name not in _REGISTRY:
        raise _error(spec, stage, f"unknown compressor {name!r}")
    cls = _REGISTRY[name]
    if (cls is Pyramid) != (inner is not None):
        problem = "pyramid needs a wrapped dropper: pyramid(<dropper>)" if cls is Pyramid else (
            f"{name} takes no parenthesised argument")
        raise _error(spec, stage, problem, name)
    fields = {f.name: f for f in _keys(cls)}
    kwargs: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in _split_top(kvs, ","))) if kvs else ():
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in fields:
            raise _error(spec, stage, f"unknown key {key!r}" if eq else f"expected key=value, got {item!r}", name)
        if key in kwargs:
            raise _error(spec, stage, f"key {key!r} given twice", name)
        kwargs[key] = _convert(spec, stage, name, fields[key], raw.strip())
    if inner is not None:
        inner_c = _parse_stage(spec, inner)
        kwargs["inner"] = inner_c
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise _error(spec, stage, str(exc), name) from None


def build_compressor(spec: str) -> Compressor:
    """Parses a compressor spec (see module docstring); raises CompressorSpecError."""
    if not isinstance(spec, str) or not spec.strip():
        raise _error(str(spec), str(spec), "empty spec")
    text = "".join(spec.split())
    stages = [_parse_stage(text, s) for s in _split_top(text, "+")]
    if len(stages) == 1:
        return stages[0]
    if len(stages) > 2:
        raise _error(text, text, "at most two stages: <dropper>+<quantizer>")
    try:
        return Composed(stages[0], stages[1])
    except ValueError as exc:
        raise _error(text, text, str(exc)) from None
