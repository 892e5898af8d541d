"""The ledger (ledger.py): each stage's row against a hand count, the honest zeros, the run facts
of LoRA and N:M, and a tiny real run that writes it (log, summary.json, ledger.png) from the
records its own loop wrote."""
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

import ledger
from model import ModelConfig, Transformer, add_lora
from sparsity import MaskedParams, apply_nm

RATES = {"flop_s": 1e9, "bytes_s": 1e8, "how": "test rates"}
# a model by hand: P = 1,000 parameters a token; 1 layer, Hq 2, Hkv 1, head_dim 4, pages of 2
FACTS = {"P": 1000, "layers": 1, "Hq": 2, "Hkv": 1, "hd": 4, "page_size": 2, "kv_bytes": 4,
         "group_size": 4, "passes": 1, "params": 1200, "trainable": 100, "grad_params": 100,
         "optimizer_bytes": 800, "model_bytes": 4800, "colocated": True, "sender": False}


def two_steps():
    """Two steps' records of a tiny run, G = 4, 2 prompts a step, counted by hand:
    step 0: try 1 draws prompts A (rewards 1 1 1 1: no spread, dropped) and B (spread); try 2
      refills with C (spread). 3 prompts of 10 tokens, each prefilled once for its 4 rows: 30
      tokens against 120. 12 completions of 5 tokens; a sparse budget reads 40 of 100 KV pages.
      Rewards: 1 duplicate (dedup), 2 cut and 1 without an answer (cheap checks), 8 reach the
      exact match, which settles 5 and sends 3 to the verifier (0.1 s a call).
    step 1: 2 prompts, both with spread, no refill; 8 completions, 20 prefill tokens against 80,
      30 of 80 pages; 8 reach the exact match, 4 go on to the verifier (0.1 s a call).
    The update ships 100 of 4,800 bytes each step."""
    base = dict(groups=2, zero_adv_groups=0, drafted=0, accepted=0, verifies=0, reach_judge=0.0,
                t_judge=0.0, sync_bytes=100, sync_full_bytes=4800)
    return [dict(base, step=0, groups_drawn=3, groups_signal=2, groups_kept=2, tries=2,
                 rollouts=12, prefill_tokens=30, prefill_tokens_naive=120, new_tokens=60,
                 pages_read=40, pages_dense=100, dedup_saved=1 / 12, truncated=2,
                 cheap_fail=1 / 12, reach_exact=8 / 12, reach_verify=3 / 12, t_verify=0.3,
                 gen_s=2.0, alpha_s=0.0, t_reward=0.5, collect_s=2.6, train_s=1.0, sync_s=0.1,
                 eval_s=0.0),
            dict(base, step=1, groups_drawn=2, groups_signal=2, groups_kept=2, tries=1,
                 rollouts=8, prefill_tokens=20, prefill_tokens_naive=80, new_tokens=40,
                 pages_read=30, pages_dense=80, dedup_saved=0.0, truncated=0, cheap_fail=0.0,
                 reach_exact=1.0, reach_verify=0.5, t_verify=0.4, gen_s=1.5, alpha_s=0.0,
                 t_reward=0.6, collect_s=2.2, train_s=1.0, sync_s=0.1, eval_s=0.5)]


def items(book, stage):
    return {it["what"]: (it["done"], it["naive"]) for it in book["stages"][stage]["items"]}


def test_each_row_against_a_hand_count():
    book = ledger.ledger(two_steps(), FACTS, seconds=10.0, rates=RATES)
    # 1 signal: 5 prompts drawn, 4 trained; A had no spread: its 4 rollouts trained nothing
    assert items(book, "signal") == {
        "prompts trained, of drawn": (4, 5), "groups with no reward spread": (1, None),
        "of them trained anyway": (0, None), "rollouts in dropped groups": (4, None),
        "refill tries": (1, None)}
    # a rollout is 10 prompt + 5 new tokens; training costs 4 P + 2 P' = 4,200 FLOPs a token
    c = book["stages"]["signal"]["compute"]
    assert (c["done"], c["naive"]) == (4 * 4 * 15 * 4200, 5 * 4 * 15 * 4200)
    # 2 rollout: the shared prompts, the sparse budget
    assert items(book, "rollout") == {"prefill tokens": (50, 200),
                                      "KV pages read (x layers)": (70, 180)}
    c = book["stages"]["rollout"]["compute"]
    page_flops, page_bytes = 4 * 2 * 2 * 4, 2 * 2 * 1 * 4 * 4  # 4 ps Hq hd; 2 ps Hkv hd bytes
    assert c["done"] == 2 * 1000 * (50 + 100) + page_flops * 70
    assert c["naive"] == 2 * 1000 * (200 + 100) + page_flops * 180
    assert c["naive_s"] == pytest.approx(c["naive"] / 1e9 + page_bytes * 180 / 1e8)
    # 3 rewards: 20 completions; dedup 1, cheap 2 + 1, exact 5 + 4, verifier 3 + 4 of 20
    assert items(book, "rewards") == {
        "completions scored": (20, None), "settled by dedup": (1, None),
        "by the cheap checks": (3, None), "by the exact match": (9, None),
        "verifier calls, of completions": (7, 20)}
    c = book["stages"]["rewards"]["compute"]
    assert c["done"] == pytest.approx(0.7) and c["naive"] == pytest.approx(20 * 0.1)
    # 4 updates: the adapter's 100 of 1,200 parameters; 800 bytes of state against 8 x 1,200
    assert items(book, "updates") == {"trainable parameters": (100, 1200),
                                      "optimizer state held": (800, 9600)}
    c = book["stages"]["updates"]["compute"]
    assert (c["done"], c["naive"]) == (4 * 4 * 15 * 4200, 4 * 4 * 15 * 6000)
    # 5 sync: 2 shipments of 100 bytes against 2 of the full 4,800
    assert items(book, "sync") == {"bytes shipped, of the full model": (200, 9600)}
    # wall time: rollout 3.5, rewards 1.1, signal 4.8 - 3.5 - 1.1, updates 2, sync 0.2, eval 0.5
    wall = book["wall_s"]
    assert wall["rollout"] == pytest.approx(3.5) and wall["signal"] == pytest.approx(0.2)
    assert wall["updates"] == 2.0 and wall["held-out eval"] == 0.5
    assert sum(wall.values()) == pytest.approx(10.0)
    text = ledger.text(book)
    assert all(len(line) <= 100 for line in text.splitlines())
    for s in ("1 signal", "2 rollout", "3 rewards", "4 updates", "5 sync", "wall time", "rates"):
        assert s in text
    assert "75%" in text and "test rates" in text  # the prefill skipped; the rates named


def test_a_skip_that_did_not_happen_shows_zero():
    """Dense decode, G = 1, every group kept, full fine-tuning, nothing shipped: 0 skipped
    everywhere, and the sync row says why it has nothing to count."""
    recs = [dict(r, groups_drawn=r["groups_kept"], groups_signal=r["groups_kept"], tries=1,
                 prefill_tokens=r["prefill_tokens_naive"], pages_read=r["pages_dense"],
                 sync_bytes=0, sync_full_bytes=0) for r in two_steps()]
    facts = dict(FACTS, trainable=1200, grad_params=1200, optimizer_bytes=9600)
    book = ledger.ledger(recs, facts, 10.0, RATES)
    for stage in ("signal", "rollout", "updates"):
        c = book["stages"][stage]["compute"]
        assert c["done"] == c["naive"] > 0, stage
    assert items(book, "signal")["refill tries"] == (0, None)
    assert book["stages"]["sync"]["compute"]["done"] == 0
    assert "nothing shipped" in book["stages"]["sync"]["note"]
    text = ledger.text(book)
    assert "100%" not in text.split("3 rewards")[0]  # no skip claimed before the rewards row


def test_the_lossless_mode_counts_its_drafts_and_may_spend_more():
    recs = [dict(r, drafted=30, accepted=24, verifies=10) for r in two_steps()]
    book = ledger.ledger(recs, FACTS, 10.0, RATES)
    got = items(book, "rollout")
    assert got["draft tokens accepted, of drafted"] == (48, 60)
    assert got["dense verifies, of dense forwards"] == (20, 100 - 20)  # a row's first: prefill
    c = book["stages"]["rollout"]["compute"]
    # drafts (60) and their verification (60 + 20 positions) against 100 dense tokens
    assert c["done"] == 2 * 1000 * (50 + 2 * 60 + 20) + 4 * 2 * 2 * 4 * 70
    assert "more" in ledger.skipped(300, 200)


def tiny_run(lora=False, nm=False):
    """run_facts' view of a tiny model: full fine-tuning, LoRA or a 2:4 mask."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = Transformer(cfg)
    if lora:
        add_lora(model, 2, 4.0, 0.0)
    masked = MaskedParams(model, apply_nm(model, 2, 4)) if nm else None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
    opt.step()
    run = SimpleNamespace(model=model, replica=None, masked=masked, opt=opt,
                          dev=torch.device("cpu"), role=SimpleNamespace(split=False), sender=None)
    setup = SimpleNamespace(page_size=16, group_size=4, passes=1)
    return ledger.run_facts(setup, run), model, masked


def test_run_facts_count_what_trains_and_what_the_optimizer_holds():
    full, model, _ = tiny_run()
    n = sum(p.numel() for p in model.parameters())
    assert full["trainable"] == full["grad_params"] == full["params"] == n
    assert full["optimizer_bytes"] >= 8 * n  # AdamW: two fp32 moments (and a step count)
    lora, model, _ = tiny_run(lora=True)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora["trainable"] == adapters < lora["params"]
    assert 8 * adapters <= lora["optimizer_bytes"] < 8 * lora["params"]
    nm, model, masked = tiny_run(nm=True)
    pruned = sum(int((~m).sum()) for m in masked.masks.values())
    assert pruned > 0 and nm["trainable"] == nm["params"] - pruned
    assert nm["grad_params"] == nm["params"]  # N:M computes every gradient, then masks it
    # a token multiplies through every parameter but the embedding (tied: the head is counted)
    assert full["P"] == n - 32 * 16 + 32 * 16


def test_a_tiny_run_prints_and_writes_its_ledger(tmp_path, monkeypatch, capsys):
    """A real run of the loop, 2 steps, with a sparse budget and a bf16 rollout copy: the ledger
    in the log, in summary.json (equal to one rebuilt from metrics.jsonl) and in ledger.png; the
    counts the loop recorded hold what is known of them by hand."""
    sys.path.insert(0, os.path.dirname(__file__))
    import train
    from fake_reward import use_parity_reward
    from test_train import TINY_RUN
    use_parity_reward(monkeypatch.setattr)  # rewards with spread, from an untrained model
    out = tmp_path / "run"
    train.main(TINY_RUN + ["--steps=2", "--plot=true", f"--out_dir={out}", "--threads=1",
                           "--kv_budget=fixed:1", "--page_size=4", "--dense_layers=0",
                           "--kv_keep_first=0", "--kv_keep_recent=1", "--rollout_copy=bf16",
                           "--eval_sampled=false"])
    assert "ledger: each stage's work" in capsys.readouterr().out
    saved = json.loads((out / "summary.json").read_text())
    book = saved["ledger"]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    again = ledger.ledger(recs, book["facts"], sum(book["wall_s"].values()), book["rates"])
    assert json.loads(json.dumps(again["stages"])) == book["stages"]
    G = 4
    t = ledger.totals(recs)
    assert t["prefill_tokens_naive"] == G * t["prefill_tokens"] > 0  # each prompt once, not G times
    assert 0 < t["pages_read"] < t["pages_dense"]  # the sparse budget skipped pages
    assert t["groups_drawn"] * G == t["rollouts"] and t["groups_kept"] <= t["groups_drawn"]
    sent, full = items(book, "sync")["bytes shipped, of the full model"]
    assert 0 < sent <= full  # the bf16 copy took deltas
    assert items(book, "updates")["trainable parameters"][0] == book["facts"]["params"]
    assert (out / "ledger.png").stat().st_size > 10_000
    # summary.json: the tables before and after RL, the count beside each figure
    table = saved["by_difficulty"]
    assert set(table) == {"before RL", "after RL"} and saved["finished"]
    n = saved["held_out"]["by_difficulty"]
    for side in table.values():
        for col in side.values():
            assert all(cell["n"] == n[d] for d, cell in col.items())


def test_seconds_print_as_plain_numbers_near_100():
    """Two significant digits below 100 s, whole seconds from there; 99.7 s is "100s", not the
    "1e+02s" that %.2g writes."""
    from ledger import human
    assert [human(x, "s") for x in (3.14, 52.4, 99.7, 102.4)] == ["3.1s", "52s", "100s", "102s"]
    assert human(0.0123, "s") == "12ms"
