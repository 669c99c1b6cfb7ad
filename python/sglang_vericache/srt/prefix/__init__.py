"""Prefixes: the ``vericache`` prefix cache, which knows rows whose full KV is in host memory
(``radix_cache``), the link to a remote tier (``remote_prefix``) and whether a server may use one
(``tier_eligibility``, ``model_identity``: the served weights' identity), and drafting while a
prefix is fetched (``draft_ahead`` with ``llama_drafter``)."""
