"""Attention: the ``vericache`` attention backend SGLang's model runner calls for prefill and
verify (``backend``), drafting attention over the compressed KV in draft rows, planned once per
step and served by the kernels in ``ops/`` (``draft_attention``), and the cheaper draft weights
(``draft_precision``)."""
