"""Undo a step's drafts in its grammar matchers without risking the scheduler.

Drafting advances each constrained row's matcher along its draft chain and rolls it back when the
drafts are done (``verify/grammar_chain.py``); the scheduler then advances it over what commits.
Only rows whose grammar can roll back are drafted (``eligibility.rolls_back``), but a grammar
object is SGLang's or a plugin's code: one whose ``rollback`` raises anyway (a wrapper this
package does not know around a grammar that cannot roll back, a backend's bug) must end its own
request, never the scheduler thread that serves every other one.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

logger = logging.getLogger(__name__)


def roll_back_or_abort(chain: Any, reqs: list[Any]) -> list[int]:
    """Every matcher of ``chain`` (a ``GrammarChain``) back where the step found it, row by row.

    A matcher whose rollback raises stands past its request's committed tokens, so no later step
    could mask that row right: its request (``reqs[row]``, ``reqs`` the batch's) ends with an
    error naming the grammar and the way around it, and the other rows still roll back.
    Returns the batch rows so ended, ascending. Idempotent, like ``GrammarChain.rollback``.
    """
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    ended = []
    for k, grammar in enumerate(chain.grammars):
        steps, chain.advanced[k] = chain.advanced[k], 0
        if not steps:
            continue
        try:
            grammar.rollback(steps)
        except Exception as error:  # any: the alternative is the scheduler thread's death
            row = chain.rows[k]
            req = reqs[row]
            logger.error("request %s: its grammar (%s) could not undo %d drafted tokens: %r; "
                         "the request ends", req.rid, type(grammar).__name__, steps,
                         error)  # fmt: skip
            req.to_finish = FINISH_ABORT(
                f"--vericache drafted this request under a grammar ({type(grammar).__name__}) "
                f"whose rollback failed ({error!r}); use a grammar backend that can roll back "
                "(--grammar-backend xgrammar or llguidance) or serve it without --vericache",
                HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError",
            )  # fmt: skip
            ended.append(row)
    return ended
