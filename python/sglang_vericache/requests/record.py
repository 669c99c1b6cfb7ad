"""One request's record: who it is, which pool row it holds, where it is in its life.

Modelled on nano-vllm's ``Sequence``: plain fields, no torch, no sglang. The components that
hold state for a request (the worker's compressed KV and counters, the remote link's lookup,
drafting ahead, the offload ledger's rows) keep their own logic and their own entries; the
record says whether the request is live and which pool row is its, and the table
(``table.py``) tells every component when it closes.

Life of a record::

    open (prefix match, prefill) --bind_row--> ROW --note_decoding--> DECODING
         \\__________________________ close (released, aborted, left the batch) ___/

A retracted request is closed when SGLang releases its row and opened again when it is
scheduled again (same id, a fresh record).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RequestEnd(str, Enum):
    """How a request's record was closed (``RequestTable.close``)."""

    RELEASED = "released"  # SGLang released its row: finished (at prefill too), aborted, retracted
    ABORTED_QUEUED = "aborted_queued"  # aborted before it held a row (SGLang's queue)
    LEFT_BATCH = "left_batch"  # gone from the decode batch with no release seen (a safety net)


@dataclass(slots=True)
class VeriRequest:
    """One live request (module doc).

    rid: SGLang's request id. row: its ``req_to_token`` row while it holds one (None before
    its prefill and after its release). decoding: it has been in a decode batch, so leaving
    one without a release means it is gone (``RequestTable.keep_only``).
    """

    rid: str
    row: int | None = None
    decoding: bool = False

    @property
    def holds_row(self) -> bool:
        return self.row is not None
