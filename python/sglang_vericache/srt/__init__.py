"""SGLang glue: how SGLang finds VeriCache, and the runtime pieces that work on SGLang's objects.

The rooms:

- here: ``plugin`` (the ``sglang.srt.plugins`` entry point: flags, defaults, incompatible
  flags), ``registration`` (the VERICACHE algorithm, the ``vericache`` attention backend and
  prefix cache), ``platform`` (the CPU platform, entry point ``sglang.srt.platforms``),
  ``engine`` (``sgl.Engine`` arguments with ``--vericache``), ``metrics`` (``meta_info`` and
  ``/metrics``);
- ``hooks/``: behaviour SGLang's hook registry wires in (penalties, grammar finish and rollback,
  request validation, the one patch);
- ``decode/``: the speculative worker and its decode step (batch inputs, step costs, plain rows'
  sampling, each row's mode, per-request records);
- ``attention/``: the ``vericache`` attention backend, drafting attention over draft rows, the
  draft weights' precision;
- ``kv/``: where a request's KV lives (offload to host memory, draft rows in the pool, staging
  for a GPU verify, what admission sees, the compressed KV's state, reinstatement);
- ``prefix/``: the ``vericache`` prefix cache and its remote tier (the link, tier eligibility,
  the served model's identity, drafting while a prefix is fetched).

Not every module imports ``sglang`` itself: many work on SGLang's pools, requests and batches by
duck typing, and import it, if at all, inside the function that needs it. Importing any of them
imports this package first, though, and with it ``sglang``: the first ``import sglang`` in a
process resolves SGLang's platform, which loads our CPU platform through its entry point
(``sglang_vericache.srt.platform:activate``). Were ``sglang_vericache.srt.platform`` the first
module to import ``sglang``, that resolution would meet it half-imported, fail to load the entry
point, and fall back to SGLang's base platform for the whole process (no device, no attention
backend). Resolving the platform here, before any submodule runs, makes every import order safe.
Logic that needs no SGLang object at all lives outside ``srt/`` (``verify/``, ``compress/``,
``tier/``, ``placement.py``, ...).
"""

from sglang.srt.platforms import current_platform as _current_platform  # noqa: F401
