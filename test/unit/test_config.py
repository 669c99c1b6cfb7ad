"""The --vericache* flags: parsing, validation messages, and the carry-over to subprocesses."""

from __future__ import annotations

import pytest

from sglang_vericache.config import (
    MAX_DRAFT_LEN,
    Placement,
    TierKind,
    TierSpec,
    VeriCacheConfig,
    VeriCacheConfigError,
    is_vericache_flag,
    parse_cli_flags,
    parse_draft_len,
)


def test_defaults_are_valid_and_disabled() -> None:
    cfg = parse_cli_flags([])
    assert cfg.enabled is False
    assert cfg.draft_len is None
    assert cfg.tier == TierSpec(TierKind.HOST)
    assert cfg.compressor  # canonical spelling of the default compressor


def test_flags_parse_from_a_full_command_line() -> None:
    argv = [
        "--model-path", "m", "--vericache", "--vericache-compressor", "snapkv:ratio=0.5+kivi:bits=4",
        "--vericache-draft-len", "16", "--vericache-tier=zmq://127.0.0.1:7300", "--port", "1",
    ]  # fmt: skip
    cfg = parse_cli_flags(argv)
    assert cfg.enabled and cfg.draft_len == 16
    assert cfg.tier == TierSpec(TierKind.ZMQ, "127.0.0.1", 7300)
    assert "snapkv" in cfg.compressor and "kivi" in cfg.compressor


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("host", TierSpec(TierKind.HOST)),
        ("zmq://10.0.0.2:7300", TierSpec(TierKind.ZMQ, "10.0.0.2", 7300)),
        ("lmcache://localhost:65432", TierSpec(TierKind.LMCACHE, "localhost", 65432)),
        ("zmq://[::1]:7300", TierSpec(TierKind.ZMQ, "::1", 7300)),
    ],
)
def test_tier_specs_round_trip(spec: str, expected: TierSpec) -> None:
    parsed = TierSpec.parse(spec)
    assert parsed == expected
    assert TierSpec.parse(str(parsed)) == parsed


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("disk", "accepted: host"),
        ("zmq://127.0.0.1", "lacks HOST:PORT"),
        ("zmq://:7300", "lacks HOST:PORT"),
        ("redis://127.0.0.1:6379", "accepted: host"),
        ("zmq://127.0.0.1:70000", "not in 1..65535"),
    ],
)
def test_bad_tier_names_the_flag_and_the_accepted_forms(spec: str, fragment: str) -> None:
    with pytest.raises(VeriCacheConfigError) as err:
        TierSpec.parse(spec)
    assert err.value.flag == "--vericache-tier"
    assert fragment in str(err.value)


@pytest.mark.parametrize("value, expected", [("auto", None), ("0", 0), ("1", 1), (str(MAX_DRAFT_LEN), 64)])
def test_draft_len_accepts_auto_and_range(value: str, expected: int | None) -> None:
    assert parse_draft_len(value) == expected


@pytest.mark.parametrize("value", ["-3", "65", "eight", "", "1.5"])
def test_draft_len_rejects_out_of_range(value: str) -> None:
    with pytest.raises(VeriCacheConfigError, match="--vericache-draft-len"):
        parse_draft_len(value)


def test_bad_compressor_names_the_flag_and_lists_valid_names() -> None:
    with pytest.raises(VeriCacheConfigError) as err:
        parse_cli_flags(["--vericache-compressor", "nonsense"])
    msg = str(err.value)
    assert msg.startswith("--vericache-compressor:")
    for name in ("streaming", "snapkv", "kivi"):
        assert name in msg


def test_bad_compressor_key_lists_valid_keys() -> None:
    with pytest.raises(VeriCacheConfigError) as err:
        parse_cli_flags(["--vericache-compressor", "kivi:bitz=4"])
    assert "bits" in str(err.value)


def test_config_survives_the_dict_round_trip() -> None:
    cfg = parse_cli_flags(
        ["--vericache", "--vericache-draft-len", "8", "--vericache-tier", "lmcache://h:1",
         "--vericache-tier-trusted-network", "--vericache-fetch-drafting", "off",
         "--vericache-tier-lookup-deadline", "0.25",
         "--vericache-tier-inflight-mb", "64", "--vericache-placement", "pressure"]
    )  # fmt: skip
    assert not cfg.fetch_drafting and cfg.placement is Placement.PRESSURE
    assert cfg.tier_lookup_deadline_s == 0.25 and cfg.tier_inflight_mb == 64
    assert cfg.tier_trusted_network
    assert VeriCacheConfig.from_dict(cfg.to_dict()) == cfg
    auto = parse_cli_flags([])
    assert VeriCacheConfig.from_dict(auto.to_dict()) == auto


@pytest.mark.parametrize("host", ["10.0.0.5", "lmcache.internal", "0.0.0.0", "[2001:db8::1]"])
def test_lmcache_off_loopback_is_refused_unless_the_network_is_trusted(host: str) -> None:
    """LMCache authenticates no one (tier/lmcache.py): refused at start-up, naming the flag."""
    spec = f"lmcache://{host}:5555"
    with pytest.raises(VeriCacheConfigError) as err:
        parse_cli_flags(["--vericache", "--vericache-tier", spec])
    assert err.value.flag == "--vericache-tier"
    assert "--vericache-tier-trusted-network" in str(err.value)
    assert "not a loopback address" in str(err.value)
    trusted = parse_cli_flags(["--vericache", "--vericache-tier", spec,
                               "--vericache-tier-trusted-network"])
    assert trusted.tier.kind is TierKind.LMCACHE and trusted.tier_trusted_network
    with pytest.raises(VeriCacheConfigError):  # what subprocesses rebuild is checked too
        VeriCacheConfig.from_dict({**trusted.to_dict(), "tier_trusted_network": False})


@pytest.mark.parametrize("spec", ["lmcache://127.0.0.1:5555", "lmcache://127.8.9.10:5555",
                                  "lmcache://localhost:5555", "lmcache://[::1]:5555",
                                  "zmq://10.0.0.5:7300"])  # zmq:// authenticates: no flag
def test_loopback_lmcache_and_remote_zmq_need_no_flag(spec: str) -> None:
    cfg = parse_cli_flags(["--vericache", "--vericache-tier", spec])
    assert str(cfg.tier) == spec and not cfg.tier_trusted_network


def test_placement_is_auto_by_default_and_a_bad_one_names_the_choices() -> None:
    assert parse_cli_flags([]).placement is Placement.AUTO
    assert parse_cli_flags(["--vericache-placement", "eager"]).placement is Placement.EAGER
    with pytest.raises(VeriCacheConfigError, match="--vericache-placement.*auto, pressure, eager"):
        parse_cli_flags(["--vericache-placement", "lazy"])


def test_fetch_drafting_is_on_or_off() -> None:
    assert parse_cli_flags([]).fetch_drafting
    with pytest.raises(VeriCacheConfigError, match="--vericache-fetch-drafting.*'on' or 'off'"):
        parse_cli_flags(["--vericache-fetch-drafting", "yes"])


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--vericache-tier-lookup-deadline", "0"),
        ("--vericache-tier-lookup-deadline", "soon"),
        ("--vericache-tier-lookup-deadline", "nan"),
        ("--vericache-tier-inflight-mb", "-5"),
        ("--vericache-tier-inflight-mb", "1.5"),
    ],
)
def test_tier_bounds_must_be_positive(flag: str, value: str) -> None:
    with pytest.raises(VeriCacheConfigError, match=f"{flag}: .*> 0"):
        parse_cli_flags([flag, value])


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("--vericache", True),
        ("--vericache-tier", True),
        ("--vericache-draft-len=4", True),
        ("--vericachex", False),
        ("--model-path", False),
    ],
)
def test_is_vericache_flag(arg: str, expected: bool) -> None:
    assert is_vericache_flag(arg) is expected
