"""The distribution SGLang's sampler draws from, as a probability vector (pure torch).

Speculative sampling is exact only if p, the full-KV distribution a draft is checked against, is
the distribution plain SGLang would sample the same token from. :func:`process_logits` rebuilds
it with the same operations, in the same order and dtype, as SGLang 0.5.23's torch sampling path
(``sglang/srt/layers/sampler.py``)::

    Sampler.forward                  all greedy (every row top_k <= 1): argmax, no softmax
                                     else logits.div_(temperatures); probs = softmax(logits)
    Sampler._sample_from_probs       no row needs top-k/top-p/min-p: multinomial(probs)
    top_k_top_p_min_p_sampling_from_probs_torch     otherwise, for EVERY row of the batch:
        sort descending (torch.topk over max_top_k columns when every row has a finite top_k
        and no seed), cumsum of the sorted probs, zero ranks >= top_k, zero ranks whose
        exclusive cumsum > top_p, zero probs < min_p * (largest prob) when any row uses min_p,
        then multinomial over what is left (multinomial normalises).

Inputs are what SGLang's sampler receives: logits after ``ModelRunner._preprocess_logits``
(penalties, logit bias, grammar vocab mask) and after the sampler's own custom-logit-processor
and NaN sanitising; parameters as normalised by ``SamplingParams`` (``temperature < 1e-6``
becomes ``temperature = 1, top_k = 1``; ``top_k = -1`` becomes ``TOP_K_ALL``).

Where this cannot mirror SGLang:

- ``--sampling-backend flashinfer`` (the CUDA default): ``top_k_top_p_sampling_from_probs``
  (joint filter) and ``top_k_renorm_prob`` / ``top_p_renorm_prob`` / ``min_p_sampling_from_probs``
  are rejection-sampling kernels with their own pivot search; their cut at the top-p / top-k
  boundary (ties, mass exactly at top_p) may differ from the torch path's. Away from the
  boundary the kept sets and the renormalised probabilities agree. Run the reference with
  ``--sampling-backend pytorch`` where bit-exact boundaries matter.
- Blackwell (sm 10.3) uses a Cake softmax kernel, ROCm a fused temperature softmax, Ascend its
  own top-k/top-p op, RL on-policy mode a bf16 log-softmax: last-bit differences only.
- ``sampling_seed`` (deterministic inference): SGLang samples with a Gumbel trick over
  ``log(probs)``; the distribution is the same vector returned here.
- Tied probabilities straddling the top-k cut are resolved by ``torch.sort`` / ``torch.topk``
  order, as in SGLang; all-greedy batches use ``argmax`` (first maximal index).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TOP_K_ALL", "RowSampling", "process_logits"]

TOP_K_ALL = 1 << 30  # sglang.srt.sampling.sampling_params.TOP_K_ALL (top_k = -1: no top-k)


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling parameters plus the batch-wide switches SGLang derives from them.

    temperatures: [rows] float32, > 0 (SGLang's ``temperatures`` is [rows, 1]; flattened here).
    top_ps: [rows] float32 in (0, 1].
    top_ks: [rows] int32 >= 1, ``TOP_K_ALL`` for no top-k.
    min_ps: [rows] float32 in [0, 1].
    all_greedy: every row has ``top_k <= 1``: SGLang takes argmax and never calls softmax.
    need_top_k / need_top_p / need_min_p: some row filters that way; any of them sends EVERY
        row through the sort-and-mask path (which is not bit-identical to plain softmax).
    max_top_k: the largest top_k when every row's top_k is finite, else None (SGLang then uses
        ``torch.topk`` over that many columns instead of a full sort, unless ``seeded``).
    seeded: SGLang's ``sampling_seed`` tensor is set (deterministic inference): full sort.
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_top_k: int | None
    seeded: bool

    def __post_init__(self) -> None:
        rows = self.temperatures.shape
        if len(rows) != 1:
            raise ValueError(f"temperatures must be [rows], got {tuple(rows)}")
        for name in ("top_ps", "top_ks", "min_ps"):
            if getattr(self, name).shape != rows:
                raise ValueError(
                    f"{name} must be [{rows[0]}], got {tuple(getattr(self, name).shape)}"
                )

    @property
    def rows(self) -> int:
        return self.temperatures.shape[0]

    @classmethod
    def of(cls, temperatures: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor,
           min_ps: torch.Tensor, *, seeded: bool = False) -> RowSampling:  # fmt: skip
        """Switches derived exactly as ``SamplingBatchInfo.from_schedule_batch`` derives them."""
        ks = [int(k) for k in top_ks.tolist()]
        finite = bool(ks) and all(1 <= k < TOP_K_ALL for k in ks)
        return cls(
            temperatures=temperatures.reshape(-1), top_ps=top_ps, top_ks=top_ks, min_ps=min_ps,
            all_greedy=all(k <= 1 for k in ks),
            need_top_k=any(k != TOP_K_ALL for k in ks),
            need_top_p=bool((top_ps != 1.0).any()),
            need_min_p=bool((min_ps > 0).any()),
            max_top_k=max(ks) if finite else None,
            seeded=seeded,
        )  # fmt: skip

    @classmethod
    def from_sampling_info(cls, info: Any) -> RowSampling:
        """From SGLang's ``SamplingBatchInfo`` (duck-typed: this package never imports sglang)."""
        return cls(
            temperatures=info.temperatures.reshape(-1), top_ps=info.top_ps, top_ks=info.top_ks,
            min_ps=info.min_ps, all_greedy=bool(info.is_all_greedy),
            need_top_k=bool(info.need_top_k_sampling), need_top_p=bool(info.need_top_p_sampling),
            need_min_p=bool(info.need_min_p_sampling), max_top_k=info.max_top_k,
            seeded=info.sampling_seed is not None,
        )  # fmt: skip

    def select(self, rows: torch.Tensor) -> RowSampling:
        """The parameters of ``rows`` ([n] int64 indices), batch-wide switches unchanged."""
        return self._with(lambda t: t.index_select(0, rows.to(t.device)))

    def repeat(self, width: int) -> RowSampling:
        """Each row's parameters ``width`` times in a row: for verify logits [rows * width, V]."""
        return self._with(lambda t: t.repeat_interleave(width, dim=0))

    def _with(self, f) -> RowSampling:
        return RowSampling(
            temperatures=f(self.temperatures), top_ps=f(self.top_ps), top_ks=f(self.top_ks),
            min_ps=f(self.min_ps), all_greedy=self.all_greedy, need_top_k=self.need_top_k,
            need_top_p=self.need_top_p, need_min_p=self.need_min_p, max_top_k=self.max_top_k,
            seeded=self.seeded,
        )  # fmt: skip


def process_logits(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """The probability vector SGLang's torch sampler draws each row's next token from.

    logits: [rows, V] float (any float dtype), one row per ``sampling`` row; not modified.
    Returns [rows, V] in ``logits.dtype``, each row non-negative and normalised to sum 1 (the
    weights ``torch.multinomial`` would receive, divided by their sum). All-greedy batches get a
    one-hot vector at ``argmax``.
    """
    if logits.dim() != 2 or logits.shape[0] != sampling.rows:
        raise ValueError(f"logits must be [{sampling.rows}, V], got {tuple(logits.shape)}")
    device = logits.device
    if sampling.all_greedy:
        hot = torch.zeros_like(logits)
        return hot.scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    # In place on a copy, as SGLang does on its own tensor: a bf16 logit divided in place by an
    # fp32 temperature stays bf16 (out of place it would promote to fp32).
    probs = logits.clone()
    probs.div_(sampling.temperatures.to(device).view(-1, 1))
    probs = torch.softmax(probs, dim=-1)
    if not (sampling.need_top_k or sampling.need_top_p or sampling.need_min_p):
        return probs / probs.sum(dim=-1, keepdim=True)
    vocab = probs.shape[-1]
    top_ks = sampling.top_ks.to(device)
    if sampling.max_top_k is not None and sampling.max_top_k < vocab and not sampling.seeded:
        # Every rank >= max_top_k is zeroed below anyway, so SGLang sorts only the head.
        probs_sort, probs_idx = torch.topk(probs, k=sampling.max_top_k, dim=-1, sorted=True)
    else:
        probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    # The cumsum is taken before any masking, exactly as SGLang does (top-p sees the unmasked
    # mass of higher ranks; ranks past top_k are zeroed regardless).
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    rank = torch.arange(probs_sort.shape[-1], device=device).view(1, -1)
    probs_sort[rank >= top_ks.view(-1, 1)] = 0.0
    probs_sort[(probs_sum - probs_sort) > sampling.top_ps.to(device).view(-1, 1)] = 0.0
    if sampling.need_min_p:
        # Rank 0 survives top-k (k >= 1) and top-p (exclusive mass 0), so this is max prob.
        thresholds = probs_sort[:, 0] * sampling.min_ps.to(device)
        probs_sort[probs_sort < thresholds.view(-1, 1)] = 0.0
    out = torch.zeros_like(probs).scatter_(-1, probs_idx, probs_sort)
    return out / out.sum(dim=-1, keepdim=True)
