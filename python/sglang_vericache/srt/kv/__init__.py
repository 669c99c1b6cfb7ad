"""Where a request's KV lives: its full KV moved to a host buffer and back (``offload``: the
moves and the host ledger; ``offloader``: the worker's calls, per request), its compressed KV in
pool slots (``draft_rows``) and its state (``draft_state``), a GPU verify's host ranges staged
while the batch drafts (``full_kv_stage``), what admission sees of all this (``admission``), and
demoted rows drafting again once room returns (``reinstate``)."""
