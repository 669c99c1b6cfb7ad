"""How VeriCache decodes each row (``DecodeMode``), and which requests make a whole step plain.

The one place that decides a row's mode::

    GREEDY   top_k <= 1 (temperature 0), nothing below applies: drafts are accepted while they
             equal the full-KV argmax (``verify.greedy_accept``), token-identical to plain greedy
    SAMPLED  temperature / top-p / top-k / min-p, nothing below applies: drafts are sampled from
             the compressed-KV distribution q and accepted by speculative sampling
             (``verify.speculative_accept``, ``verify/row_acceptance.py``), identical in
             distribution to plain sampling
    PLAIN    penalties on a sampled or grammar-constrained request, logit bias,
             ``min_new_tokens``, a custom logit processor, a grammar
             whose backend cannot roll back (outlines, also inside a reasoning parser's
             wrapper), ``max_new_tokens: 0`` (never decodes):
             no drafts; the row takes one exact token from SGLang's sampler in the same verify
             (``srt/decode/row_sampling.py``)

Grammar rows of either mode draft too: their matcher advances along the draft chain and rolls
back, and every draft and verify column is masked by its state there (``verify/grammar_chain.py``).
Greedy rows with repetition / frequency / presence penalties draft: each verify column is
penalized by a mirror of SGLang's penalizer state advanced along the chain
(``srt/decode/penalized_rows.py``). Why the rest stay plain: their logits depend on state that
SGLang 0.5.23 advances one token per step (``min_new_tokens``' length; penalties under a
sampled or grammar row's other transforms, not mirrored) or on code we cannot run on a draft
chain (a custom processor). Temperature, top-p/top-k/min-p depend on the logits
alone, and ``verify/sampling_probs.py`` rebuilds SGLang's sampling distribution from them
exactly. Logprobs are not a reason: the verify computes full-KV logits at every committed
position and they are served from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang_vericache.verify.stats import DecodeMode


def prefill_only(req: Any) -> bool:
    """``max_new_tokens: 0``: the request ends with its prefill (prompt logprobs, scoring)."""
    return req.sampling_params.max_new_tokens == 0


def tokens_left(req: Any) -> int:
    """Tokens ``req`` may still emit under its ``max_new_tokens`` (>= 0)."""
    return max(0, req.sampling_params.max_new_tokens - len(req.output_ids))


def plain_reason(req: Any) -> str | None:
    """Why ``req``'s rows are not drafted at all (None: drafted, greedy or sampled)."""
    sp = req.sampling_params
    if prefill_only(req):
        return "prefill only"
    if penalized(req) and (sp.top_k > 1 or getattr(req, "grammar", None) is not None):
        return "penalties on a sampled or constrained request"
    if sp.min_new_tokens or sp.logit_bias or getattr(req, "custom_logit_processor", None):
        return "logit processing"
    grammar = getattr(req, "grammar", None)
    if grammar is not None and not rolls_back(grammar):
        return "constrained decoding (grammar backend without rollback)"
    return None


def penalized(req: Any) -> bool:
    """Repetition, frequency or presence penalties (a greedy request's are drafted through:
    ``srt/decode/penalized_rows.py``)."""
    sp = req.sampling_params
    return bool(sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0)


def rolls_back(grammar: Any) -> bool:
    """Whether a grammar object can undo accepted tokens, which drafting along a chain needs
    (``verify/grammar_chain.py``): xgrammar and llguidance can; outlines cannot.

    Decided by the grammar that does the work: with ``--reasoning-parser`` SGLang wraps every
    grammar in a ``ReasonerGrammarObject``, whose ``rollback`` rolls back its own reasoning state
    and, for tokens after the reasoning ends, calls the wrapped grammar's (an outlines grammar's
    raises there). A wrapper around no grammar (reasoning only) rolls back its own state."""
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject

    while isinstance(grammar, ReasonerGrammarObject):
        grammar = grammar.grammar
    if grammar is None:
        return True
    rollback = getattr(type(grammar), "rollback", BaseGrammarObject.rollback)
    return rollback is not BaseGrammarObject.rollback


def decode_mode(req: Any) -> DecodeMode:
    """``req``'s mode (see the module doc). SGLang normalises temperature 0 to top_k 1, and
    treats every row with ``top_k <= 1`` as greedy (``SamplingBatchInfo.is_all_greedy``)."""
    if plain_reason(req) is not None:
        return DecodeMode.PLAIN
    return DecodeMode.GREEDY if req.sampling_params.top_k <= 1 else DecodeMode.SAMPLED


def whole_step_reason(req: Any, watermarked: bool = False) -> str | None:
    """Why ``req`` needs the whole step to be a plain decode forward (None: it does not).

    Hidden states and sampling masks are returned per forward position; SGLang's spec result
    path reads them in the verify layout only for its own workers, so a batch holding such a
    request decodes one token per row with SGLang's forward (same tokens, no drafting; its
    outputs in the spec layout: ``srt/decode/batch_inputs.py`` ``one_token_rows``).

    watermarked: SGLang's watermark forces this row's sampling (``--enable-watermark``: the
    batch's ``SamplingBatchInfo.watermark_candidates_host``). The watermark's per-request
    context advances in SGLang's sampler (``WatermarkState.force`` / ``append``, in
    ``ModelRunner.sample``), which drafted and verify-sampled rows bypass; a plain step samples
    every row there. (SGLang 0.5.23 refuses ``--enable-watermark`` with any speculative
    algorithm but NGRAM and EAGLE at start-up, so this guards a later SGLang that admits it.)
    """
    if getattr(req, "return_hidden_states", False):
        return "hidden states requested"
    if getattr(req, "return_sampling_mask", False):
        return "sampling mask requested"
    if watermarked:
        return "watermarked sampling"
    return None


@dataclass(frozen=True)
class StepRows:
    """One decode step's batch rows by how they decode (indices into ``batch.reqs``, ascending).

    drafted: GREEDY and SAMPLED rows (drafted, verified); sampled: the SAMPLED ones among them;
    grammar: the drafted ones with a grammar (masked along the chain); penalized: the drafted
    ones with penalties (greedy; penalized along the chain); plain: every other row
    (one token from SGLang's sampler in the same step); demoted: the plain rows whose compressed
    KV was dropped (``without``): what they commit follows their KV to the host; lookup_only:
    the demoted rows that still take prompt-lookup drafts (greedy, no grammar, no penalties: a
    draft of their own context needs no compressed KV, no q and no mask).
    """

    drafted: list[int]
    sampled: list[int]
    plain: list[int]
    grammar: list[int] = field(default_factory=list)
    demoted: list[int] = field(default_factory=list)
    penalized: list[int] = field(default_factory=list)
    lookup_only: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, reqs: list[Any], *, drafting: bool = True,
           watermarked: list[bool] | None = None) -> StepRows:  # fmt: skip
        """Rows of a decode batch; every row is plain when ``drafting`` is off (offload-only) or
        a request needs the whole step plain (``whole_step_reason``). watermarked: per row,
        whether the watermark forces its sampling (None: no watermark on this server)."""
        marks = watermarked or [False] * len(reqs)
        if not drafting or any(whole_step_reason(r, w) is not None
                               for r, w in zip(reqs, marks, strict=True)):
            return cls(drafted=[], sampled=[], plain=list(range(len(reqs))))
        modes = [decode_mode(r) for r in reqs]
        return cls(
            drafted=[i for i, m in enumerate(modes) if m.drafted],
            sampled=[i for i, m in enumerate(modes) if m is DecodeMode.SAMPLED],
            plain=[i for i, m in enumerate(modes) if not m.drafted],
            grammar=[i for i, m in enumerate(modes)
                     if m.drafted and getattr(reqs[i], "grammar", None) is not None],
            penalized=[i for i, m in enumerate(modes) if m.drafted and penalized(reqs[i])],
        )  # fmt: skip

    @property
    def all_greedy(self) -> bool:
        """Every row drafted and greedy without a grammar: drafts proposed elsewhere (no q, no
        mask: prompt lookup, drafting while a prefix is fetched) serve such a step only."""
        return not (self.plain or self.sampled or self.grammar)

    @property
    def lookup_rows(self) -> list[int]:
        """Rows that take prompt-lookup drafts: greedy drafted rows without a grammar (their
        penalties mirrored along the chain) and the ``lookup_only`` ones."""
        skip = {*self.sampled, *self.grammar}
        return sorted({*(i for i in self.drafted if i not in skip), *self.lookup_only})

    @property
    def takes_lookup(self) -> bool:
        """Prompt-lookup drafts can serve this step: no sampled or grammar rows (plain rows ride
        along and take SGLang's sample at column 0, as in any verify)."""
        return not (self.sampled or self.grammar)

    def without(self, rows: set[int]) -> StepRows:
        """The same step with ``rows`` decoded plainly (their compressed KV was dropped), those
        of them drafted greedy without grammar or penalties in ``lookup_only``."""
        if not rows:
            return self
        keep = lambda xs: [i for i in xs if i not in rows]  # noqa: E731
        # a row not drafted this step (the whole step plain) takes no lookup draft either
        greedy = set(self.drafted) - {*self.sampled, *self.grammar, *self.penalized}
        return StepRows(keep(self.drafted), keep(self.sampled),
                        sorted({*self.plain, *(set(self.drafted) & rows)}), keep(self.grammar),
                        sorted(rows), keep(self.penalized), sorted(greedy & rows))  # fmt: skip
