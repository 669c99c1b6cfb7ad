"""Would a layer-skipped draft pay? The model's argmax with decoder layers skipped, against its own.

A self-speculative draft (LayerSkip, SWIFT, Draft&Verify) runs the model with some decoder layers
skipped: a layer's forward becomes the identity on the residual stream, the draft is cheaper by
the layers it skips, and the verify stays the full model, so output is unchanged. What it costs
is acceptance. Greedy acceptance of one draft token is the chance that the skipped model's
argmax equals the full model's; teacher-forced over held-out prompts (the full model's own
context at every position, the full KV: the best case, before any compression), that is
measured here in one forward per skip set:

    single   each layer skipped alone: how much each one matters
    k least  the k layers that mattered least alone, skipped together: what an online choice
             from acceptance could at best converge to with k layers skipped

A draft forward that skips k of L layers costs about (L - k) / L of one (the layers are nearly
all of it at a 4x-compressed view); it pays only where acceptance stays near the full-depth
draft's over the compressed KV (86-95% at 8 x 6k: ``benchmark/README.md``, step profile).

    python benchmark/layer_skip_agreement.py                    # 4 prompts of 1-2k tokens

Writes OUT.{json,md}; default OUT benchmark/results/layer_skip_agreement.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO))

from benchmark.prompts import build_prompt_set  # noqa: E402
from sglang_vericache.models import ensure_default_model  # noqa: E402


class SkippableLayer(nn.Module):
    """A decoder layer that is the identity on the hidden states while ``skip`` is set."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.skip = inner, False
        self.attention_type = getattr(inner, "attention_type", None)  # read by the model

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        return hidden_states if self.skip else self.inner(hidden_states, *args, **kwargs)


def least_harmful(single: dict[int, float], counts: list[int]) -> dict[int, list[int]]:
    """For each k in ``counts``: the k layers whose skipping alone kept the most agreement
    (ties: the earlier layer), sorted."""
    ranked = sorted(single, key=lambda layer: (-single[layer], layer))
    return {k: sorted(ranked[:k]) for k in counts if k <= len(ranked)}


def agreement(model: nn.Module, layers: list[SkippableLayer], skip: list[int],
              ids: torch.Tensor, reference: torch.Tensor, scored: int) -> float:  # fmt: skip
    """Share of the last ``scored`` positions whose argmax with ``skip`` skipped equals
    ``reference`` ([scored] int64, the full model's)."""
    for i, layer in enumerate(layers):
        layer.skip = i in skip
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, -scored:]
    return (logits.argmax(-1) == reference).float().mean().item()


def measure(n: int, min_tokens: int, max_tokens: int, seed: int, counts: list[int]) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = [SkippableLayer(layer) for layer in model.model.layers]
    model.model.layers = nn.ModuleList(layers)
    prompts = build_prompt_set(tok, n=n, min_tokens=min_tokens, max_tokens=max_tokens, seed=seed)
    single: dict[int, list[float]] = {i: [] for i in range(len(layers))}
    cases = []  # (ids, the full model's argmax over the scored positions, scored)
    for p in tqdm(prompts, desc="prompts, each layer skipped alone"):
        ids = torch.tensor([tok.encode(p["text"])])
        scored = ids.shape[1] // 2  # the second half: every position has a long context
        with torch.no_grad():
            reference = model(ids, use_cache=False).logits[0, -scored:].argmax(-1)
        cases.append((ids, reference, scored))
        for i in tqdm(range(len(layers)), desc=p["kind"], leave=False):
            single[i].append(agreement(model, layers, [i], ids, reference, scored))
    mean = lambda xs: round(sum(xs) / len(xs), 4)  # noqa: E731
    chosen = least_harmful({i: mean(a) for i, a in single.items()}, counts)
    sets = {k: [agreement(model, layers, skip, *case) for case in cases]
            for k, skip in tqdm(chosen.items(), desc="least harmful sets")}  # fmt: skip
    return {"benchmark": "layer_skip_agreement", "date": date.today().isoformat(),
            "settings": {"n": n, "min_tokens": min_tokens, "max_tokens": max_tokens,
                         "seed": seed, "layers": len(layers), "threads": torch.get_num_threads()},
            "prompts": [{"kind": p["kind"], "tokens": ids.shape[1]}
                        for p, (ids, _, _) in zip(prompts, cases, strict=True)],
            "single": {i: mean(a) for i, a in single.items()},
            "least_harmful": [{"skipped": k, "layers": chosen[k], "agreement": mean(sets[k])}
                              for k in chosen]}  # fmt: skip


def write(result: dict, out: Path, command: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    s, single = result["settings"], result["single"]
    best = sorted(single.items(), key=lambda kv: -kv[1])[:5]
    lines = ["# Layer-skipped drafts: the skipped model's argmax against the full model's", "",
             f"`{command}` ({result['date']}, {s['threads']} threads): "
             f"{len(result['prompts'])} held-out prompts "
             f"({', '.join(str(p['kind']) + ' ' + str(p['tokens']) for p in result['prompts'])}"
             " tokens), "
             "the second half of each scored, teacher-forced over the full KV.", "",
             "| layers skipped | which | argmax agreement | draft forward layers run |",
             "|---|---|---|---|",
             "| 0 | - | 100% | 100% |"]  # fmt: skip
    for row in result["least_harmful"]:
        lines.append(f"| {row['skipped']} | {', '.join(map(str, row['layers']))} | "
                     f"{100 * row['agreement']:.1f}% | "
                     f"{100 * (s['layers'] - row['skipped']) / s['layers']:.0f}% |")
    lines += ["", "Skipped alone, the five that mattered least: "
              + ", ".join(f"layer {i} {100 * a:.1f}%" for i, a in best)
              + f"; the least of all {len(single)}: {100 * min(single.values()):.1f}%."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=4, help="held-out prompts, one of each kind in turn")
    ap.add_argument("--min-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=9101)
    ap.add_argument("--skip-counts", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results/layer_skip_agreement")
    args = ap.parse_args()
    result = measure(args.n, args.min_tokens, args.max_tokens, args.seed, args.skip_counts)
    write(result, args.out, "python " + " ".join(sys.argv))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
