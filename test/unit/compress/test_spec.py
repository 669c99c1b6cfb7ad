"""Spec parser: every compressor round-trips; bad specs name the part and list names and keys."""

from __future__ import annotations

import pytest

from sglang_vericache.compress import (
    Composed,
    CompressorSpecError,
    Pyramid,
    available_compressors,
    build_compressor,
)

SPECS = [
    "full",
    "streaming",
    "streaming:sink=0,window=16",
    "snapkv:ratio=0.25,window=8,pool=1,shared=true",
    "h2o:ratio=0.125,sink=4",
    "knorm:ratio=0.3",
    "pyramid(snapkv:ratio=0.25):beta=5",
    "pyramid(h2o)",
    "kivi:bits=2,group=16,residual=0",
    "kivi:bits=8",
    "kivi:bits=16",
    "turbo:bits=2,seed=7",
    "rotate",
    "snapkv:ratio=0.5+kivi:bits=4",
    "pyramid(knorm:ratio=0.5):beta=20+turbo:bits=4",
    "streaming:window=64+kivi:bits=2",
]


@pytest.mark.parametrize("spec", SPECS)
def test_round_trip(spec: str) -> None:
    c = build_compressor(spec)
    again = build_compressor(c.spec)
    assert again == c
    assert again.spec == c.spec


def test_every_registered_name_round_trips_with_defaults() -> None:
    names = available_compressors()
    assert {"full", "streaming", "snapkv", "h2o", "knorm", "pyramid", "kivi", "turbo"} <= set(names)
    for name in names:
        spec = "pyramid(snapkv)" if name == "pyramid" else name
        c = build_compressor(spec)
        assert isinstance(c, names[name])
        assert build_compressor(c.spec) == c


def test_composition_and_wrapper_types() -> None:
    c = build_compressor("pyramid(snapkv:ratio=0.25):beta=5+kivi:bits=2")
    assert isinstance(c, Composed) and isinstance(c.dropper, Pyramid)
    assert c.dropper.inner.ratio == 0.25 and c.quantizer.bits == 2
    assert build_compressor(" snapkv : ratio = 0.5 ") == build_compressor("snapkv:ratio=0.5")


@pytest.mark.parametrize(
    "bad, fragments",
    [
        ("nope", ["unknown compressor 'nope'", "snapkv", "kivi", "turbo"]),
        ("snapkv:rat=0.1", ["unknown key 'rat'", "Keys of snapkv", "ratio (float"]),
        ("snapkv:ratio=1.5", ["ratio must be in (0, 1]", "Keys of snapkv"]),
        ("kivi:bits=3", ["bits must be one of", "Keys of kivi", "group (int"]),
        ("kivi:bits=four", ["'four' is not a valid int"]),
        ("kivi+snapkv", ["first stage must drop tokens"]),
        ("snapkv+kivi+turbo", ["at most two stages"]),
        ("pyramid:beta=3", ["pyramid(<dropper>)"]),
        ("pyramid(kivi)", ["wraps a token dropper"]),
        ("pyramid(streaming)", ["wraps a token dropper"]),
        ("", ["empty spec"]),
        ("snapkv:ratio", ["expected key=value"]),
        ("snapkv:ratio=0.5,ratio=0.4", ["given twice"]),
    ],
)
def test_bad_spec_messages(bad: str, fragments: list[str]) -> None:
    with pytest.raises(CompressorSpecError) as info:
        build_compressor(bad)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "Valid compressors: full, streaming, snapkv, h2o, knorm, pyramid, kivi, turbo" in msg
    for frag in fragments:
        assert frag in msg, msg
