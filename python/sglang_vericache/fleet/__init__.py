"""A VeriCache fleet on one machine from one command: ``python -m sglang_vericache.fleet``.

It starts a shared full-KV tier (the zmq KV server, or LMCache's server with ``--tier lmcache``),
N ``--vericache`` SGLang replicas that join it, and SGLang's model gateway (``smg launch``) in
front of them on 127.0.0.1, then prints the one URL to use (the gateway's) on stdout. With
``--worker-urls`` it starts only the gateway, in front of replicas that run elsewhere.

Modules, pure logic apart from process management so the plan unit-tests without starting
anything:

- ``options``: the command line (``FleetOptions``);
- ``ports``: the ports the pieces listen on (``FleetPorts``);
- ``plan``: every piece's command line, environment and readiness check (``FleetPlan``);
- ``probes``: one readiness probe per kind of piece (HTTP, tier ping, TCP, gateway models);
- ``supervisor``: starts the plan's pieces in their own process groups, waits for each, and
  stops them all (on a failed start, Ctrl-C or SIGTERM);
- ``__main__``: resolves the model, allocates ports, builds the plan and runs it.

docs/FLEET.md is the user's guide.
"""
