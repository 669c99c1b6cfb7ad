"""KIVI-packed tokens in a KV pool's own slots: one page of pool slots per key group.

A draft row (``srt/kv/draft_rows.py``) keeps a quantized body in the pool it is counted in. A
slot of a layer's pool holds one token's keys in the key buffer and its values in the value
buffer, ``H_kv * D`` elements each (``slot_bytes``). A key group of G packed tokens (codes,
the group's key scale and zero per channel, a value scale and zero per token) is laid out as
one byte string per buffer, split over the page's slots in order::

    key buffer, page of group g    slot 0        slot 1       slots 2 ..
                                   scale [H, D]  zero [H, D]  codes [H, G, D * b / 8]
    value buffer, same slots       codes [H, G, D * b / 8]    (to a whole slot) scale, zero [2, H, G]

    token t's codes of head h      byte (h * G + t) * D * b / 8 of the codes
    token t's value scale, zero    element h * G + t, and (H + h) * G + t of the scales

Head-major, as a ``KiviBlock`` is: a reader of one head (the kernel's work item) touches that
head's bytes only. A slot's bytes are a multiple of a token's codes and of a scale, so none
straddles two slots: a reader walks each slot's part as one run (``ops/csrc/packed_body.h``).
The page is ``slots_per_group`` slots, the longer side's count (6 at int4, G = 32, float32,
for 32 tokens' worth of KV: about 5.3x fewer slots).

``PagedKiviBlock`` is a ``KiviBlock`` written there: its bytes live in the pool and nowhere
else; reading it as tensors (``detached``) gathers a copy. Who owns the slots decides its
lifetime: a block must not be read after its slots go back to the allocator. A fold appends
whole groups (``concat``): they wait in a ``tail`` of tensors until the store writes them to
the next pages, so a fold writes the groups it adds, not the whole body again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_vericache.compress.base import QuantizedBlock
from sglang_vericache.compress.kivi import KiviBlock


@dataclass(frozen=True, slots=True)
class KiviPageLayout:
    """Where a group of ``group`` KIVI tokens of ``bits`` bits lies in a page of pool slots
    of ``heads`` x ``head_dim`` elements of ``dtype`` (see module doc)."""

    heads: int
    head_dim: int
    bits: int
    group: int
    dtype: torch.dtype

    @classmethod
    def fits(cls, block: QuantizedBlock, key_buffer: Tensor) -> bool:
        """Whether ``block`` can be paged into a pool whose layer buffer is ``key_buffer``
        ([S, H_kv, D], contiguous): a KIVI block of 2, 4 or 8 bits (in tensors or pages
        already) in the pool's dtype and head shape, with at least two channels a head (a slot
        holds D / 2 value scales)."""
        if not isinstance(block, (KiviBlock, PagedKiviBlock)) or block.bits not in (2, 4, 8):
            return False
        layout = cls.of(block)
        _, h, d = key_buffer.shape
        return (layout.dtype == key_buffer.dtype and key_buffer.is_contiguous()
                and (layout.heads, layout.head_dim) == (h, d) and d >= 2)

    @classmethod
    def of(cls, block: "KiviBlock | PagedKiviBlock") -> "KiviPageLayout":
        """The layout ``block``'s groups take (a paged block's own)."""
        if isinstance(block, PagedKiviBlock):
            return block.layout
        h, _, d = block.key_scale.shape
        return cls(h, d, block.bits, block.group, block.key_scale.dtype)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot in one buffer (key or value) of a layer."""
        return self.heads * self.head_dim * self.dtype.itemsize

    @property
    def code_bytes(self) -> int:
        """Bytes of one token's codes, all heads (``D * b / 8`` a head)."""
        return self.heads * self.head_dim * self.bits // 8

    @property
    def code_slots(self) -> int:
        """Slots a group's codes fill in either buffer (whole slots)."""
        return -(-self.group * self.code_bytes // self.slot_bytes)

    @property
    def slots_per_group(self) -> int:
        scale_slots = -(-self.group * 2 * self.heads * self.dtype.itemsize // self.slot_bytes)
        return max(2 + self.code_slots, self.code_slots + scale_slots)

    def pages_for(self, num_tokens: int) -> int:
        """Slots ``num_tokens`` packed tokens (whole groups) take."""
        return num_tokens // self.group * self.slots_per_group

    def _bytes(self, buffer: Tensor) -> Tensor:
        """A layer's pool buffer [S, H, D] as [S, slot_bytes] uint8 (a view)."""
        return buffer.view(torch.uint8).view(buffer.shape[0], self.slot_bytes)

    def write(self, block: KiviBlock, key_buffer: Tensor, value_buffer: Tensor,
              pages: Tensor) -> None:  # fmt: skip
        """Scatter ``block``'s bytes into the slots ``pages`` [pages_for(n)] int64 of a layer's
        buffers [S, H_kv, D] (in place)."""
        n_groups, g, h = block.num_tokens // self.group, self.group, self.heads
        span = self.slots_per_group * self.slot_bytes

        def as_bytes(t: Tensor) -> Tensor:  # [n_groups, ...] -> [n_groups, bytes]
            return t.contiguous().view(torch.uint8).reshape(n_groups, -1)

        def codes(packed: Tensor) -> Tensor:  # [H, n, W] -> [n_groups, H * G * W]
            return as_bytes(packed.view(h, n_groups, g, -1).transpose(0, 1))

        key_page = block.packed_keys.new_zeros(n_groups, span)
        key_page[:, : self.slot_bytes] = as_bytes(block.key_scale.transpose(0, 1))
        key_page[:, self.slot_bytes : 2 * self.slot_bytes] = as_bytes(block.key_zero.transpose(0, 1))
        key_page[:, 2 * self.slot_bytes : 2 * self.slot_bytes + g * self.code_bytes] = codes(
            block.packed_keys)
        value_page = block.packed_values.new_zeros(n_groups, span)
        at = self._value_scales_at
        value_page[:, : g * self.code_bytes] = codes(block.packed_values)
        scales = torch.stack([block.value_scale, block.value_zero])  # [2, H, n, 1]
        value_page[:, at : at + g * 2 * h * self.dtype.itemsize] = as_bytes(
            scales[..., 0].view(2, h, n_groups, g).permute(2, 0, 1, 3))
        at_slots = pages.to(key_buffer.device)
        self._bytes(key_buffer)[at_slots] = key_page.view(-1, self.slot_bytes).to(key_buffer.device)
        self._bytes(value_buffer)[at_slots] = value_page.view(-1, self.slot_bytes).to(
            value_buffer.device)

    @property
    def _value_scales_at(self) -> int:
        """Byte offset of the value scales in a page: after the codes' whole slots."""
        return self.code_slots * self.slot_bytes

    def read(self, key_buffer: Tensor, value_buffer: Tensor, pages: Tensor,
             num_tokens: int) -> KiviBlock:  # fmt: skip
        """The ``num_tokens``-token block written at ``pages``, in tensors of its own."""
        n_groups, g, h, d = num_tokens // self.group, self.group, self.heads, self.head_dim
        at_slots = pages[: self.pages_for(num_tokens)].to(key_buffer.device)
        key_page = self._bytes(key_buffer)[at_slots].view(n_groups, -1)
        value_page = self._bytes(value_buffer)[at_slots].view(n_groups, -1)
        sb, cb = self.slot_bytes, self.code_bytes

        def floats(raw: Tensor, *shape: int) -> Tensor:
            return raw.contiguous().view(self.dtype).view(n_groups, *shape)

        def codes(raw: Tensor) -> Tensor:  # [n_groups, H * G * W] -> [H, n, W]
            return raw.reshape(n_groups, h, g, -1).transpose(0, 1).reshape(h, num_tokens, -1)

        at = self._value_scales_at
        scales = floats(value_page[:, at : at + g * 2 * h * self.dtype.itemsize], 2, h, g)
        scales = scales.permute(1, 2, 0, 3).reshape(2, h, num_tokens, 1)
        return KiviBlock(
            self.bits, self.group,
            codes(key_page[:, 2 * sb : 2 * sb + g * cb]).contiguous(),
            floats(key_page[:, :sb], h, d).transpose(0, 1).contiguous(),
            floats(key_page[:, sb : 2 * sb], h, d).transpose(0, 1).contiguous(),
            codes(value_page[:, : g * cb]).contiguous(),
            scales[0].contiguous(), scales[1].contiguous(),
        )  # fmt: skip


@dataclass(frozen=True, slots=True, eq=False)
class PagedKiviBlock(QuantizedBlock):
    """A ``KiviBlock`` whose first ``tokens`` tokens are written in one layer's pool buffers
    ([S, H_kv, D] each) at ``pages`` ([layout.pages_for(tokens)] int64 slots), then ``tail``'s
    (groups appended by ``concat``, not written yet; None once they are).

    Its bytes are the pages' and the tail's (``nbytes``); ``detached`` reads them into tensors.
    """

    layout: KiviPageLayout
    key_buffer: Tensor
    value_buffer: Tensor
    pages: Tensor
    tokens: int
    tail: KiviBlock | None = None

    @classmethod
    def write(cls, block: KiviBlock, key_buffer: Tensor, value_buffer: Tensor,
              pages: Tensor) -> "PagedKiviBlock":  # fmt: skip
        """``block`` written at the first ``pages`` it needs (the rest stay unused)."""
        layout = KiviPageLayout.of(block)
        pages = pages[: layout.pages_for(block.num_tokens)]
        layout.write(block, key_buffer, value_buffer, pages)
        return cls(layout, key_buffer, value_buffer, pages, block.num_tokens)

    @property
    def bits(self) -> int:
        return self.layout.bits

    @property
    def group(self) -> int:
        return self.layout.group

    @property
    def num_tokens(self) -> int:
        return self.tokens + (0 if self.tail is None else self.tail.num_tokens)

    @property
    def in_pool(self) -> bool:
        return self.tail is None

    @property
    def nbytes(self) -> int:
        """Both buffers' bytes of every page slot (the pool memory it takes), and the tail's."""
        tail = 0 if self.tail is None else self.tail.nbytes
        return 2 * int(self.pages.numel()) * self.layout.slot_bytes + tail

    def written(self, pages: Tensor) -> "PagedKiviBlock":
        """This block with its tail written at ``pages`` [layout.pages_for(num_tokens)], whose
        first slots are this block's ``pages`` (the same buffers): only the tail is written."""
        if self.tail is None:
            return self
        done = int(self.pages.numel())
        pages = pages[: self.layout.pages_for(self.num_tokens)]
        self.layout.write(self.tail, self.key_buffer, self.value_buffer, pages[done:])
        return PagedKiviBlock(self.layout, self.key_buffer, self.value_buffer, pages,
                              self.num_tokens)  # fmt: skip

    def detached(self) -> KiviBlock:
        body = self.layout.read(self.key_buffer, self.value_buffer, self.pages, self.tokens)
        return body if self.tail is None else body.concat(self.tail)

    def stored_tensors(self) -> tuple[Tensor, ...]:
        """A copy's tensors (``detached``): the block itself is pool slots."""
        return self.detached().stored_tensors()

    def dequantize(self) -> tuple[Tensor, Tensor]:
        return self.detached().dequantize()

    def concat(self, other: QuantizedBlock) -> QuantizedBlock:
        """self's tokens then other's: other's groups as the tail (nothing copied), or a block
        in tensors where the formats differ (raises, as ``KiviBlock.concat`` does)."""
        if not isinstance(other, KiviBlock) or (other.bits, other.group) != (self.bits, self.group):
            return self.detached().concat(other)
        tail = other if self.tail is None else self.tail.concat(other)
        return PagedKiviBlock(self.layout, self.key_buffer, self.value_buffer, self.pages,
                              self.tokens, tail)  # fmt: skip
