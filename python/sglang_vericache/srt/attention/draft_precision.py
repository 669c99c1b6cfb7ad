"""Draft forwards in a cheaper precision than the model's: shadow copies of the weights.

A draft only proposes tokens. The verify recomputes every position it commits over the full KV
with the model's own weights, and overwrites the pool slots a draft forward wrote (positions
base .. base + x are the verify's own), so a draft may run in any precision: a lower one costs
acceptance only where it flips a draft's argmax, never exactness. Where the model runs in fp32
on a CPU, a draft forward over a 4x-compressed view is bound by reading the weights (4 bytes a
parameter a forward), so it gets cheaper by what the weights cost less to read. On an
accelerator serving a bf16 model there is nothing to shadow.

Two shadow formats (``ShadowFormat``):

- a cast copy (bfloat16, or float16 off x86): the activations are cast to it and the product
  back. Fast only where the CPU multiplies in that dtype: with AVX512-BF16, SmolLM2's linears at
  8 rows took 29 + 7 ms (LM head) against 80 + 25 in fp32; with AVX2 only, bf16 ran at
  0.31-0.72x fp32's speed.
- fp16 weights packed for fbgemm's GEMM (x86 CPUs): the activations and the arithmetic stay
  fp32, the weights are read at 2 bytes and widened in registers. On an AVX2-only EPYC the
  model's linears and LM head at 8 rows took 22 ms against 62-72 in fp32 (51 against 91-114 at
  26), and fp16-rounded weights changed 0.13% of SmolLM2's argmax tokens over 3k positions
  (int8 with dynamically quantized activations, 4x faster still, changed 44-49%: not
  offered).

``DraftPrecision.install`` gives each unquantized linear layer a ``ShadowLinearMethod`` (its
quant method, wrapped: outside drafting it calls the layer's own method, so every non-draft
forward computes what it computed before, bit for bit) and the model a ``ShadowLogits`` (the
LM head likewise). ``drafting(precision)`` switches both to the shadow weights for the draft
forwards. ``choose_draft_format`` decides what to install, from a matmul timed on the serving
device.
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

MIN_SPEEDUP = 1.25  # ``auto`` shadows only where the timed matmul gains at least this
TIMED_ROWS = 8  # a draft forward's rows in the timed matmul (a decode batch, not a prefill)


@dataclass(frozen=True, slots=True)
class ShadowFormat:
    """How the shadow weights are held: ``dtype`` per element; ``packed``: fbgemm's packed fp16
    GEMM (fp32 activations and arithmetic; x86 CPUs), else a cast copy."""

    dtype: torch.dtype
    packed: bool = False

    def __post_init__(self) -> None:
        if self.packed and self.dtype != torch.float16:
            raise ValueError(f"packed shadows are float16, not {self.dtype}")

    def __str__(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        return f"{name} (packed for fbgemm, fp32 arithmetic)" if self.packed else name


def packed_fp16_available(device: torch.device) -> bool:
    """fbgemm's packed fp16 GEMM runs here (an x86 CPU with torch's fbgemm build)."""
    engines = torch.backends.quantized.supported_engines
    return device.type == "cpu" and ("fbgemm" in engines or "x86" in engines)


class CastShadow:
    """weight [out, in] and bias [out] cast to ``dtype``; x is cast to it, the product back."""

    def __init__(self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> None:
        self.weight = weight.detach().to(dtype).contiguous()
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.weight, self.bias)
                          if t is not None)  # fmt: skip

    def linear(self, x: Tensor, with_bias: bool) -> Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        bias = self.bias if with_bias else None
        return F.linear(x.to(self.weight.dtype), self.weight, bias).to(x.dtype)


class PackedFp16Shadow:
    """weight [out, in] in fp16, packed for fbgemm; bias [out] kept fp32 and added apart (a
    layer may skip its bias add)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        w = weight.detach().float().contiguous()
        self.packed = torch.ops.quantized.linear_prepack_fp16(w, None)
        self.bias = None if bias is None else bias.detach().float()
        self.nbytes = 2 * w.numel() + (0 if self.bias is None else 4 * self.bias.numel())

    def linear(self, x: Tensor, with_bias: bool) -> Tensor:
        """x [..., in] -> [..., out] in x's dtype (fp32 arithmetic)."""
        out = torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed)
        if with_bias and self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


Shadow = CastShadow | PackedFp16Shadow


def make_shadow(fmt: ShadowFormat, weight: Tensor, bias: Tensor | None = None) -> Shadow:
    return PackedFp16Shadow(weight, bias) if fmt.packed else CastShadow(weight, bias, fmt.dtype)


@dataclass(slots=True)
class DraftSwitch:
    """Whether the current forward is a draft forward (set by ``DraftPrecision.drafting``)."""

    active: bool = False


class ShadowLinearMethod:
    """A linear layer's quant method that multiplies by a shadow of the weight while drafting;
    otherwise the layer's own method (``inner``), unchanged."""

    def __init__(self, inner: Any, shadow: Shadow, switch: DraftSwitch) -> None:
        self.inner, self.shadow, self.switch = inner, shadow, switch

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if not self.switch.active:
            return self.inner.apply(layer, x, bias)
        return self.shadow.linear(x, with_bias=bias is not None)

    def __getattr__(self, name: str) -> Any:  # everything else is the layer's own method's
        return getattr(self.inner, name)


class ShadowHeadMethod:
    """The shadow LM head's quant method: SGLang's logits processor multiplies through a head's
    ``quant_method.apply`` when its type is not one of the unquantized ones."""

    def __init__(self, shadow: Shadow) -> None:
        self.shadow = shadow

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        out = self.shadow.linear(x, with_bias=False)
        return out if bias is None else out + bias  # an embedding bias, if the model has one


@dataclass(frozen=True, slots=True)
class _ShadowHead:
    """What the logits processor reads of an LM head while drafting: ``quant_method`` computes
    the product from the shadow; ``weight`` is the model's own (SGLang's checks read its shape
    and dtype; no copy, and not a module, so the model gains no parameter)."""

    weight: Tensor
    quant_method: ShadowHeadMethod


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
    """Shadow weights of one model in ``format`` and the switch that selects them.

    Mutates the model once (``install``: quant methods and the logits processor replaced by
    wrappers); afterwards, on the scheduler thread, ``switch`` changes around draft forwards and
    the shadows are remade after a weight update (``weights_changed``: SGLang's loaders copy new
    weights into the model's tensors in place, so the shadows would go on drafting the old
    model: exact still, as drafts only propose, but hardly ever accepted). ``nbytes``: what the
    shadows hold (outside the KV pool, like the weights)."""

    def __init__(self, fmt: ShadowFormat) -> None:
        self.format = fmt
        self.switch = DraftSwitch()
        self.layers = 0
        self.nbytes = 0
        self.stale = False  # the weights changed since the shadows were made
        self.refreshes = 0
        # (layer, its shadow holder): what ``refresh`` remakes each shadow from
        self._shadowed: list[tuple[nn.Module, ShadowLinearMethod | ShadowHeadMethod]] = []

    def install(self, model: nn.Module) -> "DraftPrecision":
        """Shadow every unquantized linear layer of ``model`` whose weight is in another dtype
        (quantized layers keep their kernels), and its LM head when the model's forward hands
        one to a ``logits_processor``."""
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            weight = getattr(module, "weight", None)
            if type(method).__name__ != "UnquantizedLinearMethod" or not isinstance(weight, Tensor):
                continue
            if not self._shadows(weight):
                continue
            bias = getattr(module, "bias", None)
            module.quant_method = ShadowLinearMethod(method, self._shadow_of(module), self.switch)
            self._shadowed.append((module, module.quant_method))
            self.layers += 1
        head = getattr(model, "lm_head", None)
        logits = getattr(model, "logits_processor", None)
        weight = getattr(head, "weight", None)
        if isinstance(weight, Tensor) and isinstance(logits, nn.Module) and self._shadows(weight):
            head_method = ShadowHeadMethod(self._shadow_of(head, with_bias=False))
            model.logits_processor = ShadowLogits(logits, _ShadowHead(weight, head_method),
                                                  self.switch, weight.dtype)  # fmt: skip
            self._shadowed.append((head, head_method))
            self.layers += 1
        return self

    def weights_changed(self) -> None:
        """The model's weights changed: the shadows are remade before the next draft forward
        (not here: an RL weight sync may update a model in many partial calls)."""
        self.stale = True

    def refresh(self) -> None:
        """Remake every shadow from its layer's weights now."""
        self.nbytes = 0
        for module, holder in self._shadowed:
            holder.shadow = self._shadow_of(module, with_bias=isinstance(holder,
                                                                         ShadowLinearMethod))
        self.stale = False
        self.refreshes += 1
        logger.info("draft shadow weights remade from the updated model (%d layers)",
                    self.layers)

    def _shadows(self, weight: Tensor) -> bool:
        return weight.is_floating_point() and weight.dtype != self.format.dtype

    def _shadow_of(self, module: nn.Module, with_bias: bool = True) -> Shadow:
        """A shadow of ``module``'s weight (and bias) as they are now."""
        bias = getattr(module, "bias", None) if with_bias else None
        shadow = make_shadow(self.format, module.weight, bias if isinstance(bias, Tensor) else None)
        self.nbytes += shadow.nbytes
        return shadow


@contextmanager
def drafting(precision: DraftPrecision | None) -> Iterator[None]:
    """Forwards inside run on ``precision``'s shadow weights (None: on the model's own), remade
    first where the model's weights changed since."""
    if precision is None:
        yield
        return
    if precision.stale:
        precision.refresh()
    precision.switch.active = True
    try:
        yield
    finally:
        precision.switch.active = False


def shadow_speedup(fmt: ShadowFormat, model_dtype: torch.dtype, device: torch.device,
                   features: int, repeats: int = 5) -> float:  # fmt: skip
    """How much faster a draft-sized matmul (``TIMED_ROWS`` x ``features`` by a
    ``4 * features`` x ``features`` weight, an MLP projection) runs on a ``fmt`` shadow than in
    ``model_dtype`` on ``device``: the best of ``repeats`` each."""
    w = torch.randn(4 * features, features, device=device).to(model_dtype)
    x = torch.randn(TIMED_ROWS, features, device=device).to(model_dtype)
    shadow = make_shadow(fmt, w)

    def best(run) -> float:
        times = []
        for _ in range(repeats + 1):  # the first call warms the kernel up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        return min(times[1:])

    return best(lambda: F.linear(x, w)) / max(best(lambda: shadow.linear(x, False)), 1e-9)


def choose_draft_format(setting: str, model_dtype: torch.dtype, device: torch.device,
                        features: int) -> ShadowFormat | None:  # fmt: skip
    """The shadow format for ``--vericache-draft-dtype`` (None: draft in the model's weights).

    ``model``: never. ``bfloat16``: a cast copy. ``float16``: packed for fbgemm where it runs
    (``packed_fp16_available``), else a cast copy. Neither where the model already runs in that
    dtype. ``auto``: where the model runs in fp32, the candidate whose draft-sized matmul is
    fastest on this device, if at least ``MIN_SPEEDUP`` times fp32's (packed fp16 where fbgemm
    runs, and bfloat16: a CPU without bf16 instructions gains nothing from it).
    """
    if setting == "model":
        return None
    if setting != "auto":
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[setting]
        packed = dtype == torch.float16 and packed_fp16_available(device)
        return None if dtype == model_dtype else ShadowFormat(dtype, packed)
    if model_dtype != torch.float32:
        return None
    candidates = [ShadowFormat(torch.bfloat16)]
    if packed_fp16_available(device):
        candidates.insert(0, ShadowFormat(torch.float16, packed=True))
    speedups = {fmt: shadow_speedup(fmt, model_dtype, device, features) for fmt in candidates}
    logger.info("draft precision: a draft-sized matmul against fp32's here: %s",
                ", ".join(f"{fmt} {s:.2f}x" for fmt, s in speedups.items()))  # fmt: skip
    fmt, speedup = max(speedups.items(), key=lambda item: item[1])
    return fmt if speedup >= MIN_SPEEDUP else None
