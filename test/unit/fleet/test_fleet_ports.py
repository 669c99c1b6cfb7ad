"""Port allocation: asked-for ports kept, the rest drawn distinct (no sockets opened)."""

from __future__ import annotations

import itertools

import pytest
from sglang_vericache.fleet.options import FleetOptions
from sglang_vericache.fleet.ports import PortAllocationError, allocate_ports


def counter(start: int = 20000):
    ports = itertools.count(start)
    return lambda: next(ports)


def test_every_piece_gets_its_own_port() -> None:
    ports = allocate_ports(FleetOptions(replicas=3, port=0), counter())
    assert len(ports.replicas) == 3 and ports.tier is not None and ports.tier_aux == ()
    assert len(set(ports.all())) == len(ports.all()) == 6


def test_asked_for_ports_are_kept_and_never_drawn_again() -> None:
    draws = iter([30000, 7300, 30000, 7300, 20001, 20002, 20003])
    ports = allocate_ports(FleetOptions(port=30000, tier_port=7300), lambda: next(draws))
    assert (ports.gateway, ports.tier) == (30000, 7300)
    assert ports.gateway_metrics == 20001 and ports.replicas == (20002, 20003)


def test_lmcache_gets_its_http_and_metrics_ports_too() -> None:
    ports = allocate_ports(FleetOptions(tier="lmcache", port=0), counter())
    assert len(ports.tier_aux) == 2 and len(set(ports.all())) == len(ports.all()) == 7


def test_worker_urls_allocate_only_the_gateways_ports() -> None:
    ports = allocate_ports(FleetOptions(worker_urls=("http://a:1",), tier_port=7300),
                           counter())
    assert ports.tier is None and ports.replicas == () and ports.gateway == 30000
    assert ports.gateway_metrics == 20000


def test_the_same_port_twice_is_refused() -> None:
    with pytest.raises(PortAllocationError, match="twice"):
        allocate_ports(FleetOptions(port=7300, tier_port=7300), counter())


def test_a_picker_that_only_returns_taken_ports_fails_instead_of_looping() -> None:
    with pytest.raises(PortAllocationError, match="no free port"):
        allocate_ports(FleetOptions(port=30000), lambda: 30000)
