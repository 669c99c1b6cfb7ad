"""How long do drafts from a compressed KV survive verification? (paper Fig. 9 analogue, CPU)

For every compressor family at 2x/4x/8x *measured* compression (bytes of the tensors actually
stored vs the full KV in the model's dtype), on a fixed offline prompt set:
  (a) tokens lossy-only greedy decoding from the compressed cache matches full-KV greedy before
      its first divergence (capped at the horizon; the first token comes from the full prefill),
      and the mean KL(full KV || compressed) of the next-token distributions over those steps;
  (b) mean accepted length per verify when drafting x tokens from the compressed cache and
      verifying against the full KV (accepted = matched draft prefix + 1 correction/bonus token;
      committed tokens join the compressed cache with their exact KV, via CompressedLayerCache);
  (c) bytes per token of the compressed prompt KV (all layers, K and V).
The full-KV greedy continuation is the reference trajectory, so a verify needs no forward: the
accepted length is read off the reference. Chains of one prompt are drafted in batches.

    python benchmark/compressors.py            # full run, ~35 min on 2 CPU cores
    python benchmark/compressors.py --quick    # smoke run (< 2 min)
Results: benchmark/results/compressors.{json,md}, compressors_accept.png, compressors_match.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sglang_vericache.compress import (
    CompressedLayerCache,
    Observation,
    build_compressor,
)

from benchmark.compressors_chains import Chain, reference, run_chains
from benchmark.compressors_engine import DraftEngine
from benchmark.compressors_report import write_outputs
from benchmark.prompts import build_prompt_set, prompt_set_digest

DROPPERS = ("streaming", "snapkv", "h2o", "knorm", "pyramid")
QUANTIZERS = ("kivi", "turbo")
FAMILIES = DROPPERS + QUANTIZERS + ("snapkv+kivi",)


def family_spec(family: str, target: float, knob: float) -> str:
    """Spec of ``family`` for a knob in [0, 1] (kept fraction / window / residual share)."""
    r = round(max(knob, 1e-4), 4)
    if family == "full":  # sanity reference: must match the full-KV trajectory exactly
        return "full"
    if family == "streaming":
        return f"streaming:sink=4,window={max(1, int(knob))}"
    if family in ("snapkv", "h2o"):
        return f"{family}:ratio={r},window=32"
    if family == "knorm":
        return f"knorm:ratio={r},window=32,sink=4"
    if family == "pyramid":
        return f"pyramid(snapkv:ratio={r},window=32):beta=20"
    if family == "kivi":
        bits = 8 if target <= 3 else 4 if target <= 5 else 2
        return f"kivi:bits={bits},group=32,residual={int(knob)}"
    if family == "turbo":
        bits = 8 if target <= 3.5 else 4 if target <= 6.5 else 2
        return f"turbo:bits={bits},seed=0,residual={int(knob)}"
    if family == "snapkv+kivi":
        bits = 8 if target <= 4 else 4
        return f"snapkv:ratio={r},window=32+kivi:bits={bits},group=32,residual=32"
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def _integer_knob(family: str) -> bool:
    return family in ("streaming", "kivi", "turbo")


def _sizing_spec(spec: str) -> str:
    """A spec with the same stored bytes but a cheap scorer: sizes depend on kept counts only."""
    for name in ("snapkv", "h2o"):
        spec = spec.replace(f"{name}:", "knorm:")
    if spec.startswith("pyramid("):  # same total budget as the flat dropper (up to rounding)
        spec = spec[len("pyramid("): spec.index(")")] + spec[spec.index(")") + 1:].split(":beta=")[1].partition("+")[1] \
            + spec.partition("+")[2]
    return spec


def measured_ratio(spec: str, t: int, geo) -> float:
    """Full bytes / stored bytes of a T-token layer (sizes do not depend on the values)."""
    comp = build_compressor(_sizing_spec(spec))
    k = torch.ones(geo.num_kv_heads, t, geo.head_dim, dtype=geo.dtype)
    c = comp.compress(0, k, k, Observation())
    return c.full_nbytes() / c.nbytes


def fit_spec(family: str, target: float, t: int, geo) -> str:
    """The spec of ``family`` with the largest knob whose measured ratio is >= target."""
    if family == "full":
        return "full"
    lo, hi = (0.0, float(t)) if _integer_knob(family) else (0.0, 1.0)
    if measured_ratio(family_spec(family, target, hi), t, geo) >= target:
        return family_spec(family, target, hi)
    for _ in range(40 if _integer_knob(family) else 16):
        mid = (lo + hi) / 2
        if _integer_knob(family):
            mid = math.floor(mid)
            if mid == lo:
                break
        if measured_ratio(family_spec(family, target, mid), t, geo) >= target:
            lo = mid
        else:
            hi = mid
    return family_spec(family, target, lo)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description="Compressor acceptance benchmark (see module docstring)"
    )
    ap.add_argument(
        "--model",
        default=None,
        help="HF model dir; default the embedded SmolLM2; 'tiny-random' for tests",
    )
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--min-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument(
        "--horizon", type=int, default=48, help="committed tokens per verify chain; lossy cap"
    )
    ap.add_argument("--ratios", default="2,4,8")
    ap.add_argument("--draft-lengths", default="8,16,32")
    ap.add_argument(
        "--all-x-at", type=float, default=4.0, help="ratio measured at every draft length"
    )
    ap.add_argument("--main-x", type=int, default=16, help="draft length measured at every ratio")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--h2o-stride", type=int, default=8)
    ap.add_argument("--mem-gb", type=float, default=1.2, help="draft buffer memory per batch")
    ap.add_argument("--threads", type=int, default=1, help="1: two OpenMP threads stall on a shared 2-core box")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 short prompts, few configs")
    ap.add_argument("--shard", default=None, help="K/N: run prompts K, K+N, ... only (parallel runs); "
                    "raw rows go to .cache/compressors-shards/, combine with --merge N")
    ap.add_argument("--merge", default=None, help="N (shards 0/N..N-1/N) or a list K/N,...: combine saved shards into the outputs")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.min_tokens, args.max_tokens, args.horizon = 2, 300, 500, 16
        args.ratios, args.draft_lengths, args.main_x = "4", "4,8", 8
        args.families = "streaming,snapkv,pyramid,kivi,snapkv+kivi"
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    model, tok, model_name = load_model(args.model)
    engine = DraftEngine(model, banned_token=getattr(tok, "eos_token_id", None))
    geo = engine.geo
    families = args.families.split(",")
    ratios = [float(r) for r in args.ratios.split(",")]
    xs = [int(x) for x in args.draft_lengths.split(",")]
    prompts = build_prompt_set(tok, args.prompts, args.min_tokens, args.max_tokens, seed=0)
    configs = [(f, r) for f in families for r in ratios]
    rows = {
        cfg: {
            "specs": [],
            "ratio": [],
            "bytes_per_token": [],
            "matched": [],
            "kl": [],
            "accepted": {x: [] for x in xs},
        }
        for cfg in configs
    }
    started = time.time()
    if args.merge is not None:
        return _merge(args, model_name, geo, prompts, tok, rows, families, ratios, xs)
    todo = prompts
    skip, cpu_offset = 0, 0.0
    if args.shard is not None:
        k, n = (int(v) for v in args.shard.split("/"))
        todo = prompts[k::n]
        skip, prior_s, prior_cpu = _resume_shard(args, rows, xs)  # a restarted shard continues
        todo = todo[skip:]
        started, cpu_offset = started - prior_s, prior_cpu
    lossy_len = args.horizon + max(xs) + 2
    bar = tqdm(todo, desc="compressors", unit="prompt")
    cpu_started = time.process_time() - cpu_offset
    doc: dict = {}
    for done, prompt in enumerate(bar):
        ids = torch.tensor(tok.encode(prompt["text"]), dtype=torch.int64)
        t = ids.numel()
        bar.set_postfix_str(f"{prompt['id']} T={t} prefill")
        need_attn = any("h2o" in f for f in families)
        pre = engine.prefill(ids, 32, args.h2o_stride if need_attn else None)
        bar.set_postfix_str(f"{prompt['id']} T={t} reference")
        ref = reference(engine, pre, t, lossy_len)
        chains = []
        bar.set_postfix_str(f"{prompt['id']} T={t} compress")
        for ci, (fam, target) in enumerate(configs):
            spec = fit_spec(fam, target, t, geo)
            comp = build_compressor(spec)
            compressed = []
            for li in range(geo.num_layers):
                obs = Observation(
                    pre.last_queries[li],
                    torch.arange(t - pre.last_queries[li].shape[1], t),
                    pre.attention[li] if pre.attention else None,
                    geo.num_layers,
                )
                compressed.append(comp.compress(li, pre.keys[li], pre.values[li], obs))
            stored = sum(c.nbytes for c in compressed)
            row = rows[(fam, target)]
            row["specs"].append(spec)
            row["ratio"].append(sum(c.full_nbytes() for c in compressed) / stored)
            row["bytes_per_token"].append(stored / t)
            # mk() runs only within this iteration, so late binding of comp/compressed is harmless
            mk = lambda: [
                CompressedLayerCache(comp, li, c, num_layers=geo.num_layers)  # noqa: B023
                for li, c in enumerate(compressed)  # noqa: B023
            ]
            chains.append(Chain(ci, 0, True, mk()))
            for x in xs:
                if x == args.main_x or abs(target - args.all_x_at) < 1e-9:
                    chains.append(Chain(ci, x, False, mk()))
        bar.set_postfix_str(f"{prompt['id']} T={t} draft {len(chains)} chains")
        run_chains(engine, chains, ref, t, args.horizon, args.mem_gb * 2**30)
        for c in chains:
            row = rows[configs[c.config]]
            if c.lossy:
                row["matched"].append(c.matched)
                row["kl"].append(c.kl_sum / max(c.kl_steps, 1))
            else:
                row["accepted"][c.x].append(c.accepted)
        # Written after every prompt, so an interrupted run still leaves consistent results.
        if args.shard is not None:
            _save_shard(args, rows, skip + done + 1, started, cpu_started)
            continue
        meta = _meta(args, model_name, geo, prompts, tok, done + 1, started, cpu_started)
        doc = write_outputs(Path(args.out_dir), meta, rows, families, ratios, xs, DROPPERS, QUANTIZERS, args)
    return doc


SHARD_DIR = Path(__file__).resolve().parent.parent / ".cache" / "compressors-shards"


def _save_shard(args, rows: dict, done: int, started: float, cpu_started: float) -> None:
    k, n = args.shard.split("/")
    SHARD_DIR.mkdir(parents=True, exist_ok=True)
    raw = {f"{f}|{r}": {**row, "accepted": {str(x): a for x, a in row["accepted"].items()}}
           for (f, r), row in rows.items()}
    doc = {"rows": raw, "done": done, "settings": _shard_settings(args), "seconds": time.time() - started,
           "cpu_seconds": time.process_time() - cpu_started}
    tmp = SHARD_DIR / f"shard-{k}-of-{n}.json.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.replace(SHARD_DIR / f"shard-{k}-of-{n}.json")


def _resume_shard(args, rows: dict, xs: list[int]) -> tuple[int, float, float]:
    """Loads a shard's saved rows (same settings) into ``rows``; returns (prompts it covers,
    wall seconds, CPU seconds so far)."""
    k, n = args.shard.split("/")
    path = SHARD_DIR / f"shard-{k}-of-{n}.json"
    if not path.exists():
        return 0, 0.0, 0.0
    shard = json.loads(path.read_text())
    if shard.get("settings") != _shard_settings(args) or not _has_kl(shard):
        return 0, 0.0, 0.0  # another run's shard, or one from before KL was measured: redo
    _add_shard_rows(rows, shard, xs)
    return shard["done"], shard["seconds"], shard["cpu_seconds"]


def _has_kl(shard: dict) -> bool:
    return all("kl" in row for row in shard["rows"].values())


def _add_shard_rows(rows: dict, shard: dict, xs: list[int]) -> None:
    """Appends a saved shard's per-prompt values to ``rows``."""
    for (f, r), row in rows.items():
        got = shard["rows"][f"{f}|{r}"]
        for key in ("specs", "ratio", "bytes_per_token", "matched", "kl"):
            row[key].extend(got[key])
        for x in xs:
            row["accepted"][x].extend(got["accepted"][str(x)])


def _shard_settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("out_dir", "mem_gb", "merge")}


def _merge(args, model_name, geo, prompts, tok, rows, families, ratios, xs) -> dict:
    """Combines the raw rows of N shard runs (same settings) into the outputs."""
    names = [f"{k}/{args.merge}" for k in range(int(args.merge))] if "/" not in args.merge else args.merge.split(",")
    done, seconds, cpu = 0, 0.0, 0.0
    for name in names:
        k, n = name.split("/")
        shard = json.loads((SHARD_DIR / f"shard-{k}-of-{n}.json").read_text())
        if not _has_kl(shard):
            raise SystemExit(f"shard {name} predates the KL measurement: run it again")
        done, seconds, cpu = done + shard["done"], max(seconds, shard["seconds"]), cpu + shard["cpu_seconds"]
        _add_shard_rows(rows, shard, xs)
    meta = _meta(args, model_name, geo, prompts, tok, done, time.time(), time.process_time())
    meta.update(seconds=round(seconds, 1), cpu_seconds=round(cpu, 1), shards=names)
    return write_outputs(Path(args.out_dir), meta, rows, families, ratios, xs, DROPPERS, QUANTIZERS, args)


def _meta(args, model_name: str, geo, prompts: list[dict], tok, done: int, started: float,
          cpu_started: float) -> dict:
    return {
        "model": model_name,
        "geometry": {"layers": geo.num_layers, "q_heads": geo.num_q_heads, "kv_heads": geo.num_kv_heads,
                     "head_dim": geo.head_dim, "dtype": str(geo.dtype)},
        "prompt_set": {"n": len(prompts), "done": done, "digest": prompt_set_digest(prompts),
                       "kinds": [p["kind"] for p in prompts],
                       "tokens": [len(tok.encode(p["text"])) for p in prompts]},
        "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "seconds": round(time.time() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu_started, 1),
        "cpu_threads": args.threads,
        "host_cpus": os.cpu_count(),
    }


class ByteTokenizer:
    """Bytes as token ids (tests: the tiny random model has no real tokenizer)."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def load_model(name: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if name == "tiny-random":
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        )
        return LlamaForCausalLM(cfg).eval(), ByteTokenizer(), "tiny-random-llama"
    if name is None:
        from sglang_vericache.models import DEFAULT_MODEL_NAME, ensure_default_model

        path, label = str(ensure_default_model()), DEFAULT_MODEL_NAME
    else:
        path, label = name, Path(name).name
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path), label


if __name__ == "__main__":
    main()
