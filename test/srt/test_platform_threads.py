"""The CPU platform's OpenMP wait default: a short spin, unless the environment chose."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from sglang_vericache.srt.platform import (
    GOMP_SPINCOUNT,
    OMP_WAIT_POLICY,
    SPIN_COUNT,
    TorchCpuPlatform,
)


@pytest.fixture
def bare_env(monkeypatch):
    """Neither variable set; whatever the platform sets is undone after the test."""
    for name in (OMP_WAIT_POLICY, GOMP_SPINCOUNT):
        monkeypatch.setenv(name, "recorded")  # so the undo restores the original state
        monkeypatch.delenv(name)
    return monkeypatch


def _defaults() -> SimpleNamespace:
    args = SimpleNamespace(dtype="auto", mem_fraction_static=None, sleep_on_idle=False)
    TorchCpuPlatform().apply_server_args_defaults(args)
    return args


def test_schedulers_spin_briefly_by_default(bare_env) -> None:
    args = _defaults()
    assert os.environ[GOMP_SPINCOUNT] == SPIN_COUNT == "1000"
    assert OMP_WAIT_POLICY not in os.environ
    assert args.sleep_on_idle and args.dtype == "float32"


@pytest.mark.parametrize("name, value", [(OMP_WAIT_POLICY, "PASSIVE"), (GOMP_SPINCOUNT, "50")])
def test_an_explicit_openmp_choice_is_kept(bare_env, name, value) -> None:
    bare_env.setenv(name, value)
    _defaults()
    assert os.environ[name] == value
    if name == OMP_WAIT_POLICY:
        assert GOMP_SPINCOUNT not in os.environ
