"""SGLang glue: the plugin, the CPU platform, the speculative worker and its pool views.

Every module here imports ``sglang``. The first ``import sglang`` in a process resolves
SGLang's platform, which loads our CPU platform through its entry point
(``sglang_vericache.srt.platform:activate``). Were ``sglang_vericache.srt.platform`` the
first module to import ``sglang``, that resolution would meet it half-imported, fail to load
the entry point, and fall back to SGLang's base platform for the whole process (no device, no
attention backend). Resolving the platform here, before any submodule runs, makes every
import order safe.
"""

from sglang.srt.platforms import current_platform as _current_platform  # noqa: F401
