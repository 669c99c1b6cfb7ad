"""KV pool sizing on the CPU platform: a share of total host RAM, not of what is free now.

The two-servers-at-once experiment this fixes (the second server used to refuse to start) costs
two server starts; it is described in the platform module and checked by hand. These tests pin
the arithmetic and the messages.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.sglang

GIB = 1 << 30


@pytest.fixture(scope="module")
def platform():
    import sglang.srt.platforms  # noqa: F401  (resolves the platform first: no import cycle)

    from sglang_vericache.srt import platform

    return platform


def test_default_pool_is_a_capped_share_of_total_ram(platform) -> None:
    budget = platform.cpu_kv_budget(total=23 * GIB, available=20 * GIB, weights=GIB // 2,
                                    fraction=0.2, capped=True)  # fmt: skip
    assert budget.nbytes == platform.CPU_KV_POOL_CAP_BYTES and "cap" in budget.reason
    small = platform.cpu_kv_budget(total=8 * GIB, available=7 * GIB, weights=GIB // 2,
                                   fraction=0.2, capped=True)  # fmt: skip
    assert small.nbytes == int(0.2 * 8 * GIB - GIB // 2) and "host RAM" in small.reason


def test_pool_does_not_depend_on_what_another_server_just_took(platform) -> None:
    """The bug: sized from available memory, a server starting beside another saw the other's
    pool as used and got nothing. From total RAM both get the same pool."""
    kw = {"total": 23 * GIB, "weights": GIB // 2, "fraction": 0.2, "capped": True}
    alone = platform.cpu_kv_budget(available=21 * GIB, **kw)
    beside = platform.cpu_kv_budget(available=16 * GIB, **kw)
    assert alone == beside


def test_crowded_host_gets_a_smaller_pool_not_an_oom(platform) -> None:
    budget = platform.cpu_kv_budget(total=23 * GIB, available=2 * GIB, weights=GIB // 2,
                                    fraction=0.2, capped=True)  # fmt: skip
    assert budget.nbytes == GIB and "available" in budget.reason


def test_explicit_fraction_lifts_the_cap(platform) -> None:
    budget = platform.cpu_kv_budget(total=64 * GIB, available=60 * GIB, weights=GIB,
                                    fraction=0.3, capped=False)  # fmt: skip
    assert budget.nbytes == int(0.3 * 64 * GIB - GIB)


def test_max_total_tokens_sizes_the_pool_exactly(platform) -> None:
    budget = platform.cpu_kv_budget(total=23 * GIB, available=20 * GIB, weights=GIB,
                                    fraction=0.01, capped=True, needed=3 * GIB)  # fmt: skip
    assert budget.nbytes == 3 * GIB and budget.reason == "--max-total-tokens"


def test_failures_name_the_flag_to_set(platform) -> None:
    with pytest.raises(ValueError, match="--mem-fraction-static above 0.250.*--max-total-tokens"):
        platform.cpu_kv_budget(total=8 * GIB, available=7 * GIB, weights=2 * GIB,
                               fraction=0.2, capped=True)  # fmt: skip
    with pytest.raises(ValueError, match="lower --max-total-tokens"):
        platform.cpu_kv_budget(total=8 * GIB, available=GIB, weights=GIB // 2,
                               fraction=0.2, capped=True, needed=2 * GIB)  # fmt: skip


def test_default_fraction_is_told_apart_from_a_user_value(platform) -> None:
    declared = SimpleNamespace(_resolved_overrides=[("platform:cpu", {"mem_fraction_static": 0.2})])
    user = SimpleNamespace(_resolved_overrides=[("cli", {"dtype": "float32"})])
    assert platform._fraction_is_default(declared, 0.2)
    assert not platform._fraction_is_default(user, 0.3)
    assert platform._fraction_is_default(SimpleNamespace(), platform.CPU_MEM_FRACTION_STATIC)
