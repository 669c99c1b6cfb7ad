"""The mask half of SGLang's grammar-object interface (``BaseGrammarObject``), for test grammars.

A subclass says which tokens are allowed (``fill_vocab_mask``) and how it advances and rolls
back; the mask itself is a bool tensor, True = allowed, as xgrammar's and llguidance's are
after ``move_vocab_mask``.
"""

from __future__ import annotations

import torch


class BoolMaskGrammar:
    """Allocation, device move and application of a ``[batch, vocab]`` bool mask."""

    @staticmethod
    def allocate_vocab_mask(vocab_size: int, batch_size: int, device) -> torch.Tensor:
        return torch.ones(batch_size, vocab_size, dtype=torch.bool, device=device)

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device) -> torch.Tensor:
        return vocab_mask.to(device)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        logits.masked_fill_(~vocab_mask, float("-inf"))
