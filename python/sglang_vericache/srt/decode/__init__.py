"""The decode step: SGLang's speculative worker for VERICACHE (``worker``) and what it runs each
step: draft, verify, commit (``decode_step``), the batch's inputs rewritten in place for each of
its forwards (``batch_inputs``), what the worker tells the planner and the placement policy about
a batch (``step_costs``), plain rows' sampling and logprobs (``row_sampling``), each row's mode
(``eligibility``) and one VeriCache record per request (``request_book``). The acceptance
arithmetic itself (``row_acceptance``, ``draft_length``, ...) is in ``verify/``."""
