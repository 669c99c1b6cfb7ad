"""Draft forwards in a cheaper precision than the model's: shadow copies of the weights.

A draft only proposes tokens. The verify recomputes every position it commits over the full KV
with the model's own weights, and overwrites the pool slots a draft forward wrote (positions
base .. base + x are the verify's own), so a draft may run in any precision: a lower one costs
acceptance only where it flips a draft's argmax, never exactness. Where the model runs in fp32
on a CPU, a draft forward over a 4x-compressed view is bound by reading the weights (about 4
bytes a parameter a forward; SmolLM2 at 8 rows: 80 ms of linears + 25 ms of LM head, against
29 + 7 ms in bf16 on a CPU with AVX512-BF16), so the draft forward gets cheaper by what the
weights cost less to read. On an accelerator serving a bf16 model there is nothing to shadow.

``DraftPrecision.install`` gives each unquantized linear layer a ``ShadowLinearMethod`` (its
quant method, wrapped: outside drafting it calls the layer's own method, so every non-draft
forward computes what it computed before, bit for bit) and the model a ``ShadowLogits`` (the
LM head likewise). ``drafting(precision)`` switches both to the shadow weights for the draft forwards.
``choose_draft_dtype`` decides whether to install, from a matmul timed on the serving device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MIN_SPEEDUP = 1.25  # ``auto`` shadows only where the timed matmul gains at least this
TIMED_ROWS = 8  # a draft forward's rows in the timed matmul (a decode batch, not a prefill)


@dataclass(slots=True)
class DraftSwitch:
    """Whether the current forward is a draft forward (set by ``DraftPrecision.drafting``)."""

    active: bool = False


class ShadowLinearMethod:
    """A linear layer's quant method that multiplies by a shadow copy of the weight while
    drafting; otherwise the layer's own method (``inner``), unchanged."""

    def __init__(self, inner: Any, weight: Tensor, bias: Tensor | None,
                 switch: DraftSwitch) -> None:  # fmt: skip
        self.inner, self.weight, self.bias, self.switch = inner, weight, bias, switch

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if not self.switch.active:
            return self.inner.apply(layer, x, bias)
        shadow_bias = None if bias is None else self.bias
        return F.linear(x.to(self.weight.dtype), self.weight, shadow_bias).to(x.dtype)

    def __getattr__(self, name: str) -> Any:  # everything else is the layer's own method's
        return getattr(self.inner, name)


class _ShadowHead(nn.Module):
    """What the logits processor reads of an LM head: its ``weight`` (here, the shadow)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class ShadowLogits(nn.Module):
    """The model's logits processor, handed the shadow LM head while drafting. Its logits are
    cast back to the model's dtype; their rounding (a shadow dtype's) only moves drafts."""

    def __init__(self, inner: nn.Module, head: _ShadowHead, switch: DraftSwitch,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.inner, self.head, self.switch, self.dtype = inner, head, switch, dtype

    def forward(self, input_ids: Tensor, hidden_states: Tensor, lm_head: nn.Module,
                *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        if not self.switch.active:
            return self.inner(input_ids, hidden_states, lm_head, *args, **kwargs)
        out = self.inner(input_ids, hidden_states, self.head, *args, **kwargs)
        if out.next_token_logits is not None:
            out.next_token_logits = out.next_token_logits.to(self.dtype)
        return out


class DraftPrecision:
    """Shadow weights of one model in ``dtype`` and the switch that selects them.

    Mutates the model once (``install``: quant methods and the logits processor replaced by
    wrappers); afterwards only ``switch`` changes, on the scheduler thread, around draft
    forwards. ``nbytes``: what the shadows hold (outside the KV pool, like the weights)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.switch = DraftSwitch()
        self.layers = 0
        self.nbytes = 0

    def install(self, model: nn.Module) -> "DraftPrecision":
        """Shadow every unquantized linear layer of ``model`` whose weight is in another dtype
        (quantized layers keep their kernels), and its LM head when the model's forward hands
        one to a ``logits_processor``."""
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            weight = getattr(module, "weight", None)
            if type(method).__name__ != "UnquantizedLinearMethod" or not isinstance(weight, Tensor):
                continue
            if weight.dtype == self.dtype or not weight.is_floating_point():
                continue
            bias = getattr(module, "bias", None)
            shadow_bias = bias.detach().to(self.dtype) if isinstance(bias, Tensor) else None
            module.quant_method = ShadowLinearMethod(method, self._shadow(weight), shadow_bias,
                                                     self.switch)  # fmt: skip
            self.layers += 1
        head = getattr(model, "lm_head", None)
        logits = getattr(model, "logits_processor", None)
        if isinstance(getattr(head, "weight", None), Tensor) and isinstance(logits, nn.Module):
            model_dtype = head.weight.dtype
            model.logits_processor = ShadowLogits(logits, _ShadowHead(self._shadow(head.weight)),
                                                  self.switch, model_dtype)  # fmt: skip
            self.layers += 1
        return self

    def _shadow(self, weight: Tensor) -> Tensor:
        shadow = weight.detach().to(self.dtype).contiguous()
        self.nbytes += shadow.numel() * shadow.element_size()
        return shadow


@contextmanager
def drafting(precision: DraftPrecision | None) -> Iterator[None]:
    """Forwards inside run on ``precision``'s shadow weights (None: on the model's own)."""
    if precision is None:
        yield
        return
    precision.switch.active = True
    try:
        yield
    finally:
        precision.switch.active = False


def matmul_speedup(dtype: torch.dtype, model_dtype: torch.dtype, device: torch.device,
                   features: int, repeats: int = 5) -> float:  # fmt: skip
    """How much faster a draft-sized matmul (``TIMED_ROWS`` x ``features`` by a
    ``4 * features`` x ``features`` weight, an MLP projection) runs in ``dtype`` than in
    ``model_dtype`` on ``device``: the best of ``repeats`` each."""
    def best(dt: torch.dtype) -> float:
        w = torch.randn(4 * features, features, device=device).to(dt)
        x = torch.randn(TIMED_ROWS, features, device=device).to(dt)
        times = []
        for _ in range(repeats + 1):  # the first call warms the kernel up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            F.linear(x, w)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        return min(times[1:])

    return best(model_dtype) / max(best(dtype), 1e-9)


def choose_draft_dtype(setting: str, model_dtype: torch.dtype, device: torch.device,
                       features: int) -> torch.dtype | None:  # fmt: skip
    """The shadow dtype for ``--vericache-draft-dtype`` (None: draft in the model's weights).

    ``model``: never. ``bfloat16`` / ``float16``: that dtype unless the model already runs in
    it. ``auto``: bfloat16 where the model runs in fp32 and a draft-sized matmul is at least
    ``MIN_SPEEDUP`` times faster in it on this device (a CPU without bf16 instructions is not).
    """
    if setting == "model":
        return None
    if setting != "auto":
        dtype = DTYPES[setting]
        return None if dtype == model_dtype else dtype
    if model_dtype != torch.float32:
        return None
    speedup = matmul_speedup(torch.bfloat16, model_dtype, device, features)
    logger.info("draft precision: a draft-sized bf16 matmul is %.2fx fp32's here", speedup)
    return torch.bfloat16 if speedup >= MIN_SPEEDUP else None
