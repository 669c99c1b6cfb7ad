"""The per-step call sequence the spec worker follows, on a toy token model.

A deterministic "target" gives the greedy next token; the "drafter" is the
same function made wrong at pseudo-random positions (a lossy compressed
cache). Whatever the drafter does, the committed output must equal the
target's greedy decoding, with EOS and max_new_tokens honoured.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang_vericache.verify import (
    AcceptanceConfig,
    AcceptanceEstimate,
    FetchState,
    Phase,
    RingConfig,
    StaggerConfig,
    StaggerScheduler,
    TransferDemand,
    VeriCacheMetrics,
    VerifyWindow,
    greedy_accept,
    truncate_committed,
)

VOCAB, EOS = 41, 0


def target_next(seq: list[int]) -> int:
    nxt = (seq[-1] * 7 + len(seq) * 3 + seq[0]) % VOCAB
    return nxt if nxt != EOS or len(seq) > 25 else 1


def reference(prompt: list[int], max_new: int) -> list[int]:
    seq = list(prompt)
    while len(seq) - len(prompt) < max_new:
        seq.append(target_next(seq))
        if seq[-1] == EOS:
            break
    return seq[len(prompt):]


def run(seed: int, draft_len: int | None, miss_rate: float, fetch_latency: int) -> None:
    rng = random.Random(seed)
    sched = StaggerScheduler(StaggerConfig(min_len=1, max_len=8, rings=RingConfig(
        horizon_steps=16, link_bytes_per_step=300, buffer_bytes=2000)))
    metrics = VeriCacheMetrics()
    eos = torch.tensor([EOS])

    n_req = 6
    prompts = {f"r{i}": [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 5))]
               for i in range(n_req)}
    max_new = {rid: rng.randint(1, 40) for rid in prompts}
    arrival = {rid: rng.randint(0, 20) for rid in prompts}
    seqs: dict[str, list[int]] = {}
    windows: dict[str, VerifyWindow] = {}
    estimates: dict[str, AcceptanceEstimate] = {}
    fetch_ready: dict[str, int] = {}
    demand = TransferDemand(link_bytes=500, buffer_bytes=400)
    done: set[str] = set()

    def draft_next(rid: str, seq: list[int]) -> int:
        tok = target_next(seq)
        if random.Random(f"{seed}/{rid}/{len(seq)}/{windows[rid].stats.verify_steps}").random() \
                < miss_rate:
            tok = (tok + 1) % VOCAB
        return tok

    def new_window_len(rid: str) -> int:
        left = max_new[rid] - (len(seqs[rid]) - len(prompts[rid]))
        # fixed, or longer while drafts survive (the choice never affects exactness)
        x = draft_len or (8 if estimates[rid].alpha > 0.5 else 2)
        return min(x, max(0, left - 1))

    for t in range(2000):
        now = t * 0.01
        for rid, at in arrival.items():  # "prefill": the first token is a plain decode
            if at == t:
                seqs[rid] = prompts[rid] + [target_next(prompts[rid])]
                estimates[rid] = AcceptanceEstimate(AcceptanceConfig())
                if seqs[rid][-1] == EOS or max_new[rid] == 1:
                    done.add(rid)
                    continue
                windows[rid] = VerifyWindow(rid, target_len=0)
                windows[rid].retarget(new_window_len(rid))
                sched.submit(rid, t, windows[rid].target_len, demand)
        active = [r for r in windows if r not in done]
        if not active and len(done) == n_req:
            break
        plan = sched.step(t, max(len(active), 1))
        for wp in plan.planned:
            win = windows[wp.rid]
            if win.phase is Phase.DRAFT:
                win.retarget(max(wp.draft_len, win.num_drafted))
        for rid in plan.start_fetch:
            windows[rid].start_fetch(demand.link_bytes)
            fetch_ready[rid] = t + fetch_latency
        for rid in active:
            win = windows[rid]
            if win.fetch is FetchState.IN_FLIGHT and t >= fetch_ready[rid]:
                win.fetch_done(now)
        verifying = []
        for rid in plan.verify:
            win = windows[rid]
            if win.phase is Phase.DRAFT:
                win.end_draft(now)
            if win.ready_to_verify():
                verifying.append(rid)
        for rid in active:  # one draft step for everybody else
            win = windows[rid]
            if rid not in verifying and win.draft_room > 0:
                tok = draft_next(rid, seqs[rid] + list(win.drafts))
                win.add_drafts([tok])
                if tok == EOS:
                    win.end_draft(now)  # stop drafting at EOS
        if verifying:
            width = max(windows[r].num_drafted for r in verifying) + 1
            rows, preds, lens, remaining = [], [], [], []
            for rid in verifying:
                d = list(windows[rid].drafts)
                row = [seqs[rid][-1]] + d + [rng.randrange(VOCAB)] * (width - 1 - len(d))
                ctx = seqs[rid][:-1]
                preds.append([target_next(ctx + row[: j + 1]) for j in range(width)])
                rows.append(row)
                lens.append(len(d))
                remaining.append(max_new[rid] - (len(seqs[rid]) - len(prompts[rid])))
            res = greedy_accept(torch.tensor(rows), torch.tensor(preds), torch.tensor(lens))
            keep = truncate_committed(res.committed, res.accept_lens, eos,
                                      torch.tensor(remaining))
            for i, rid in enumerate(verifying):
                win = windows[rid]
                win.begin_verify()
                tokens = res.row_tokens(i)[: int(keep[i])]
                rec = win.resolve(tokens)
                metrics.observe_verify(rec)
                estimates[rid].update(rec.drafted, rec.accepted)
                seqs[rid].extend(tokens)
                sched.complete(rid)
                generated = len(seqs[rid]) - len(prompts[rid])
                if tokens[-1] == EOS or generated >= max_new[rid]:
                    win.finish()
                    done.add(rid)
                else:
                    win.settle(new_window_len(rid))
                    sched.submit(rid, t + 1, win.target_len, demand)
        for win in windows.values():
            win.check_integrity()
            estimates[win.rid].check_integrity()
        sched.check_integrity()
        metrics.check_integrity()
    assert done == set(prompts), "every request finished"
    for rid, prompt in prompts.items():
        assert seqs[rid][len(prompt):] == reference(prompt, max_new[rid]), rid
    total = [w.stats for w in windows.values()]
    assert metrics.verify_steps == sum(s.verify_steps for s in total)
    assert metrics.accepted == sum(s.accepted for s in total)
    if miss_rate == 0.0:
        assert metrics.accepted > 0
    if windows:
        assert metrics.bytes_fetched == 500 * metrics.verify_steps


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("draft_len,miss_rate,fetch_latency",
                         [(4, 0.0, 0), (4, 0.3, 2), (None, 0.1, 1), (None, 0.9, 0), (1, 0.5, 3)])
def test_loop_output_equals_greedy_reference(seed: int, draft_len: int | None, miss_rate: float,
                                             fetch_latency: int) -> None:
    run(seed, draft_len, miss_rate, fetch_latency)
