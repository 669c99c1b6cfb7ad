"""The ports a fleet's pieces listen on, all on 127.0.0.1 except the gateway's bind address.

Ports asked for on the command line are kept; every other one (0 there, and the ones nobody
asks for: each replica's, the gateway's metrics port, LMCache's HTTP and metrics ports) is
drawn from ``pick_free`` (``exactness.server.free_port`` at run time: below the kernel's
ephemeral range, so a client socket cannot take it meanwhile) and is distinct from every other.
The gateway's metrics port is always set: smg's default (29000) would make two fleets, or a
fleet beside another gateway, collide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sglang_vericache.fleet.options import FleetOptions

DRAWS_PER_PORT = 32  # a pick_free that keeps returning taken ports is broken, not unlucky


class PortAllocationError(RuntimeError):
    """Two pieces asked for the same port, or no distinct free port could be drawn."""


@dataclass(frozen=True, slots=True)
class FleetPorts:
    """``tier`` None: no tier started here (--worker-urls). ``tier_aux``: LMCache's HTTP and
    metrics ports (empty for the zmq KV server)."""

    gateway: int
    gateway_metrics: int
    replicas: tuple[int, ...] = ()
    tier: int | None = None
    tier_aux: tuple[int, ...] = ()

    def all(self) -> list[int]:
        tier = [] if self.tier is None else [self.tier]
        return [self.gateway, self.gateway_metrics, *self.replicas, *tier, *self.tier_aux]


class _Draw:
    """Hands out ports distinct from each other and from the fixed ones."""

    def __init__(self, pick_free: Callable[[], int], fixed: list[int]) -> None:
        if len(set(fixed)) != len(fixed):
            raise PortAllocationError(f"the same port asked for twice: {sorted(fixed)}")
        self.pick_free = pick_free
        self.taken = set(fixed)

    def one(self, wanted: int = 0) -> int:
        if wanted:
            return wanted  # fixed: already in self.taken
        for _ in range(DRAWS_PER_PORT):
            port = self.pick_free()
            if port not in self.taken:
                self.taken.add(port)
                return port
        raise PortAllocationError(f"no free port distinct from {sorted(self.taken)}")


def allocate_ports(options: FleetOptions, pick_free: Callable[[], int]) -> FleetPorts:
    starts_tier = not options.remote
    fixed = [p for p in (options.port, options.tier_port if starts_tier else 0) if p]
    draw = _Draw(pick_free, fixed)
    gateway = draw.one(options.port)
    gateway_metrics = draw.one()
    if not starts_tier:
        return FleetPorts(gateway=gateway, gateway_metrics=gateway_metrics)
    tier = draw.one(options.tier_port)
    aux = (draw.one(), draw.one()) if options.tier == "lmcache" else ()
    replicas = tuple(draw.one() for _ in range(options.replicas))
    return FleetPorts(gateway=gateway, gateway_metrics=gateway_metrics, replicas=replicas,
                      tier=tier, tier_aux=aux)
