"""source_profile.py: py-spy samples are charged to the step phase that holds them and to the
innermost component they run in."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmark.source_profile import OUTSIDE, classify, markdown, tally

LOOP = "Scheduler.run_batch (scheduler.py:1);VeriCacheWorker.forward_batch_generation (worker.py:2)"
MODEL = "LlamaForCausalLM.forward (llama.py:9);LlamaAttention.forward (llama.py:10)"


def _stack(*frames: str) -> str:
    return ";".join((LOOP,) + frames)


def test_a_sample_goes_to_its_outermost_phase_and_innermost_component() -> None:
    draft = _stack("DecodeStep.run (decode_step.py:3)",
                   "DecodeStep._verify_step (decode_step.py:4)",
                   "DecodeStep._draft (decode_step.py:5)", MODEL,
                   "DraftPlan.attend (draft_attention.py:96)")  # fmt: skip
    assert classify(draft.split(";")) == ("draft forward", "attention (SDPA)")
    read = _stack("DecodeStep._verify_step (decode_step.py:4)", MODEL,
                  "VeriCacheAttnBackend._attend_new_tokens (attention.py:1)",
                  "OffloadLedger.read (offload.py:207)",
                  "read_pool_kv (offload.py:258)")  # fmt: skip
    assert classify(read.split(";")) == ("verify forward", "full-KV read")
    norm = _stack("DecodeStep._plain_step (decode_step.py:6)", MODEL,
                  "RMSNorm.forward_native (layernorm.py:1)")  # fmt: skip
    assert classify(norm.split(";")) == ("plain forward", "other model ops")
    assert classify(LOOP.split(";")) == ("scheduler", OUTSIDE)


def test_tally_and_table_add_up_to_every_sample() -> None:
    raw = "\n".join([
        _stack("DecodeStep._draft (d.py:5)", MODEL,
               "UnquantizedLinearMethod.apply (u.py:1)") + " 30",
        _stack("DecodeStep._verify_step (d.py:4)", MODEL,
               "LogitsProcessor._compute_lm_head (l.py:1)") + " 10",
        LOOP + " 10",
    ])  # fmt: skip
    table = tally(raw)
    assert table == {"draft forward": {"linear layers": 30},
                     "verify forward": {"LM head": 10}, "scheduler": {OUTSIDE: 10}}  # fmt: skip
    settings = {"concurrency": 8, "prompt_tokens": 7000, "compressor": "snapkv:ratio=0.25",
                "draft_len": "auto", "seconds": 60, "rate": 40}  # fmt: skip
    text = markdown({"settings": settings, "samples": table})
    assert "| draft forward | 60.0% |" in text and "| scheduler | 20.0% |" in text
