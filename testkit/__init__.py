"""Test tooling, not shipped: the request fuzzer (``fuzz*.py``) and the child-process fixtures
for the zmq KV server (``tier_server``) and a real ``lmcache server`` (``lmcache_server``), used
by ``test/`` and ``benchmark/`` only.

It lives at the repository root, outside ``python/`` (setuptools finds packages under
``python/`` only), so the wheel carries the product and the exactness CLI and nothing else.
Import it with the repository root on ``sys.path``: pytest adds it (``pythonpath`` in
pyproject.toml); benchmark scripts insert it themselves.
"""
