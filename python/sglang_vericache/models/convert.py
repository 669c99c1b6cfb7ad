"""Convert a GGUF Llama checkpoint into a plain fp32 Hugging Face directory.

transformers de-quantizes GGUF weights when it loads them, but refuses to ``save_pretrained`` a
model it considers "gguf-quantized"; so we rebuild a plain ``LlamaForCausalLM`` from the loaded
config and state dict and save that. The result is SmolLM2 with Q4_1-rounded weights, stored in
fp32: exactness is always measured against this same checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)


def convert_gguf_llama(gguf: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Write ``config.json``, ``model.safetensors`` and tokenizer files for ``gguf`` to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    steps = tqdm(total=4, desc=f"convert {gguf.name}", disable=not progress)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    steps.update()
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    plain = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    del loaded
    steps.update()
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    steps.update()
    steps.close()
    logger.info("converted %s -> %s", gguf, out_dir)
