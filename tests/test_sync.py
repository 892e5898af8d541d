"""Stage 5: bit-exact delta sync, version checks, adapter merge, and the distributed and file
transports."""
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import sync
from model import ModelConfig, Transformer, weight_checksum
from sync import FileTransport, Receiver, Sender, Update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def bits(t):
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def random_weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(64, 256, generator=g), "mid": torch.randn(1000, generator=g),
            "small": torch.randn(3, 5, generator=g), "norm": torch.ones(32)}


def perturb(sd, rnd, g):
    """One trainer step of a chosen kind; returns its name."""
    kind = ["none", "all", "sparse", "dense", "signed_zero"][rnd % 5]
    for v in sd.values():
        if kind == "all":
            v.neg_()  # flips every sign bit, so every element changes, even after a bf16 cast
        elif kind in ("sparse", "dense"):
            p = 0.001 if kind == "sparse" else 0.4
            m = torch.rand(v.shape, generator=g) < p
            v[m] += torch.randn(int(m.sum()), generator=g)
        elif kind == "signed_zero":  # equal as values, different as bits: must still be shipped
            v.view(-1)[:2] = torch.tensor([0.0, -0.0]) if rnd % 2 else torch.tensor([-0.0, 0.0])
    return kind


# ----------------------------------------------------------------------------- delta sync


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_sync_is_bit_exact_over_many_rounds(dtype):
    g = torch.Generator().manual_seed(1)
    trainer = random_weights()
    rollout = {k: torch.zeros_like(v, dtype=dtype) for k, v in trainer.items()}
    sender, receiver = Sender(trainer, dtype=dtype), Receiver(rollout)
    receiver.apply(sender.make_update())  # v1 is full
    seen = set()
    for rnd in range(30):
        kind = perturb(trainer, rnd, g)
        u = sender.make_update()
        if rnd % 2:  # half the rounds go through the wire format
            u = Update.from_bytes(u.to_bytes())
        assert isinstance(u, sync.DeltaUpdate) and (u.base_version, u.version) == (rnd + 1, rnd + 2)
        receiver.apply(u)  # verifies the checksum itself
        assert receiver.checksum() == sender.checksum() == u.checksum
        for k, v in trainer.items():
            assert same_bits(rollout[k], v.to(dtype)), f"round {rnd} ({kind}) tensor {k}"
        for name, d in u.info.items():  # the cheapest encoding wins
            costs = sync.delta_costs(rollout[name].numel(), d["changed"],
                                     rollout[name].element_size())
            payload = sum(t.numel() * t.element_size() for k, t in u.tensors.items()
                          if k.startswith(name + "|"))
            assert payload <= min(costs.values())
            assert d["enc"] == "zdiff" or costs[d["enc"]] == payload == min(costs.values())
            seen.add(d["enc"])
        s = sender.stats()
        assert (s["bytes"] == u.nbytes
                and s["full_bytes"] == sum(v.numel() * v.element_size() for v in rollout.values()))
        if kind == "none":
            assert (u.nbytes == 0 and u.info == {} and len(u.to_bytes()) < 400
                    and s["changed_fraction"] == 0)
        if kind == "all":  # every sign bit flips: the same step everywhere, which zdiff packs
            assert s["changed_fraction"] == 1.0 and u.nbytes < s["full_bytes"]
        if kind == "sparse":
            assert s["ratio"] < 0.05
    assert {"mask", "index", "zdiff"} <= seen  # (dense loses to zdiff even when all changed)


def test_pack_bits_and_costs():
    np = pytest.importorskip("numpy")
    for n in (0, 1, 8, 13, 1000):
        m = torch.rand(n) < 0.3
        p = sync.pack_bits(m)
        assert (p.tolist() == np.packbits(m.numpy()).tolist()
                and torch.equal(sync.unpack_bits(p, n), m))
    assert sync.delta_costs(800, 10, 2) == {"dense": 1600, "mask": 120, "index": 60}
    assert sync.delta_costs(2**31, 1, 2)["index"] == 10  # int64 indices past 2^31 elements


def test_wrong_base_version_and_bad_updates_are_refused():
    trainer = random_weights()
    sender = Sender(trainer, dtype=torch.bfloat16)
    behind = Receiver({k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in trainer.items()})
    behind.apply(sender.make_update())
    trainer["big"][0, 0] += 1
    sender.make_update()  # v2: never reaches `behind`
    trainer["big"][1, 1] += 1
    u3 = sender.make_update()
    with pytest.raises(ValueError, match=r"delta update v2->v3 needs the receiver on version 2, "
                                         r"but it is on version 1"):
        behind.apply(u3)
    fresh = Receiver({k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in trainer.items()})
    with pytest.raises(ValueError, match="v2->v3 .* on version 0"):
        fresh.apply(u3)
    fresh.apply(sender.make_update(full=True))  # a full update resyncs whoever is behind
    assert fresh.version == 4 and fresh.checksum() == sender.checksum()
    trainer["mid"][3] += 1
    bad = sender.make_update()
    bad.checksum = "0" * 64
    with pytest.raises(RuntimeError, match="checksum mismatch after applying delta update v4->v5"):
        fresh.apply(bad)
    fp32 = Receiver({k: torch.zeros_like(v) for k, v in trainer.items()})
    with pytest.raises(ValueError,
                       match="tensor 'big': update has bfloat16 .* receiver holds float32"):
        fp32.apply(sender.make_update(full=True))
    with pytest.raises(KeyError, match="receiver has no tensor 'small'"):
        Receiver({k: v for k, v in fp32.weights.items()
                  if k != "small"}).apply(Sender(trainer).make_update())


def test_module_sync_ties_and_matches_weight_checksum():
    torch.manual_seed(0)
    policy = Transformer(TINY)
    rollout = Transformer(TINY).to(torch.bfloat16)
    # an engine that stores lm_head separately
    untied = {k: v.clone() for k, v in rollout.state_dict().items()}
    sender = Sender(policy, dtype=torch.bfloat16)
    first = sender.make_update()
    assert list(first.aliases.items()) == [("model.embed_tokens.weight", "lm_head.weight")]
    assert "model.embed_tokens.weight" not in first.tensors  # a tied weight ships once
    for r in (Receiver(rollout), Receiver(untied)):
        r.apply(first)
        assert r.checksum() == sender.checksum()
    assert sender.checksum()[:16] == weight_checksum(rollout)
    assert torch.equal(untied["lm_head.weight"], untied["model.embed_tokens.weight"])
    # Both sides loaded the same checkpoint: no first
    # full sync, the first update is already a delta.
    same = copy.deepcopy(policy).to(torch.bfloat16)
    s2, r2 = Sender(policy, dtype=torch.bfloat16, synced=True), Receiver(same)
    assert s2.checksum() == r2.checksum()
    with torch.no_grad():
        policy.model.norm.weight[:3] += 1
    u = s2.make_update()
    assert (u.kind, u.base_version, list(u.info)) == ("delta", 0, ["model.norm.weight"])
    r2.apply(u)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_delta_sync_on_cuda():
    g = torch.Generator().manual_seed(2)
    trainer = {k: v.cuda() for k, v in random_weights().items()}
    rollout = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in trainer.items()}
    sender, receiver = Sender(trainer, dtype=torch.bfloat16), Receiver(rollout)
    receiver.apply(sender.make_update())
    for rnd in range(10):
        cpu = {k: v.cpu() for k, v in trainer.items()}
        perturb(cpu, rnd, g)
        for k in trainer:
            trainer[k].copy_(cpu[k])
        receiver.apply(Update.from_bytes(sender.make_update().to_bytes()))
        assert all(same_bits(rollout[k], v.to(torch.bfloat16)) for k, v in trainer.items())


def test_simulated_rl_step_bytes():
    """An Adam step with a small lr: nearly every fp32 element moves, most of the moves vanish after
    a bf16 cast."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        out[dtype] = sync.simulate_rl_sync(steps=2, lr=1e-5, dtype=dtype, cfg=TINY)[-1]
        s = out[dtype]
        print(f"\n[sync] Adam lr=1e-5, {str(dtype)[6:]} receiver: changed "
              f"{s['changed_fraction']:.2%}, delta {s['bytes']:,} B of full {s['full_bytes']:,} B "
              f"(ratio {s['ratio']:.3f}), {s['encodings']}")
    assert out[torch.float32]["changed_fraction"] > 0.9
    assert out[torch.bfloat16]["changed_fraction"] < 0.5 and out[torch.bfloat16]["ratio"] < 0.5


def test_bf16_delta_into_a_rollout_copy_equals_a_local_refresh():
    """Adam steps on the policy; one bf16 copy follows by bf16 deltas, another by a local refresh
    (copies.refresh_rollout_copy): every tensor equal bit for bit after every step, and a delta
    ships only the elements whose bf16 bits changed."""
    from copies import make_rollout_copy, refresh_rollout_copy
    torch.manual_seed(0)
    policy = Transformer(TINY)
    shipped, local = make_rollout_copy(policy, "bf16"), make_rollout_copy(policy, "bf16")
    sender = Sender(policy, dtype=torch.bfloat16, synced=True)
    receiver = Receiver(shipped)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, betas=(0.9, 0.99))
    encodings = set()
    for step in range(4):
        idx = torch.randint(0, TINY.vocab_size, (2, 16))
        loss = torch.nn.functional.cross_entropy(policy(idx[:, :-1]).flatten(0, 1),
                                                 idx[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        before = {k: v.clone() for k, v in shipped.state_dict().items()}
        update = Update.from_bytes(sender.make_update().to_bytes())  # as it crosses the wire
        receiver.apply(update)
        refresh_rollout_copy(local, policy)
        a, b = shipped.state_dict(), local.state_dict()
        assert a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
        assert all(v.dtype == torch.bfloat16 for v in update.tensors.values()
                   if v.is_floating_point())
        changed = sum(int((bits(a[k]) != bits(before[k])).sum()) for k in update.info)
        assert sum(d["changed"] for d in update.info.values()) == changed > 0
        assert 0 < sender.stats()["bytes"] < sender.stats()["full_bytes"]
        encodings |= {d["enc"] for d in update.info.values()}
    assert "zdiff" in encodings  # the compressed steps applied too, not only new values


def test_bf16_copy_in_the_loop_logs_its_delta_bytes(tmp_path, monkeypatch):
    """Colocated, rollout_copy=bf16: the copy follows by checked bf16 deltas and every step logs
    the bytes against the full bf16 model's."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import train
    from fake_reward import use_parity_reward
    use_parity_reward(monkeypatch.setattr)
    run = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--ffn=64",
           "--sft_steps=3", "--sft_batch=8", "--n_train=64", "--n_eval=8", "--prompts_per_step=4",
           "--group_size=4", "--max_new_tokens=8", "--steps=2", "--eval_every=100",
           "--plot=false", "--difficulty=(1,2)", "--lr=1e-4", "--rollout_copy=bf16",
           "--save_every=100", f"--out_dir={tmp_path}"]
    recs = train.main(run)["records"]
    trained = [r for r in recs if r["tokens"] > 0]
    assert trained and all("sync_bytes" in r for r in recs)
    for r in trained:
        assert 0 < r["sync_bytes"] < r["sync_full_bytes"]
        assert r["sync_ratio"] == r["sync_bytes"] / r["sync_full_bytes"]


# ----------------------------------------------------------------------------- adapters


def test_adapter_sync_plus_merge_equals_merged_full_sync():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = Transformer(TINY)
    lora_cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    trainer = peft.inject_adapter_in_model(lora_cfg, copy.deepcopy(base))
    scaling = 8 / 4
    lora = [p for n, p in trainer.named_parameters() if "lora_" in n]
    sender = Sender(trainer, mode="adapter")
    merged_model, serving = (copy.deepcopy(base),
                             peft.inject_adapter_in_model(lora_cfg, copy.deepcopy(base)))
    merging = Receiver(merged_model, lora_scaling=scaling)  # merges into its weights
    # an engine that runs the LoRA unmerged: its own lora tensors get written
    keeping = Receiver(serving)
    # no lora tensors, no scaling: it only holds the adapter
    holding = Receiver(copy.deepcopy(base))
    full_rx = Receiver(copy.deepcopy(base))
    for rnd in range(2):
        with torch.no_grad():  # a training step on the adapter only (lora_B starts at zero)
            for p in lora:
                p.add_(torch.randn_like(p) * 0.1)
        u = sender.make_update()
        assert isinstance(u, sync.AdapterUpdate) and all("lora_" in k for k in u.tensors)
        assert u.nbytes < 0.2 * sum(v.numel() * 4 for v in base.state_dict().values())
        for r in (merging, keeping, holding):
            r.apply(u)
            assert r.checksum() == sender.checksum()
        adapter = {k: v for k, v in trainer.state_dict().items() if "lora_" in k}
        # what a merged full sync would ship
        merged = sync.merge_lora(base.state_dict(), adapter, scaling)
        full_tx = Sender(merged, mode="full")
        full_rx.apply(full_tx.make_update(version=rnd + 1))
        for k, v in full_rx.weights.items():
            assert same_bits(merging.weights[k], v), k
    idx = torch.randint(0, TINY.vocab_size, (2, 9))
    with torch.no_grad():
        # unmerged LoRA on the serving engine computes what the merged weights compute
        assert (serving(idx) - merged_model(idx)).abs().max() <= 1e-5
    ref = copy.deepcopy(trainer)  # PEFT's own merge agrees
    for m in ref.modules():
        if hasattr(m, "merge") and hasattr(m, "base_layer"):
            m.merge()
    for k, v in ref.state_dict().items():
        if "base_layer" in k:
            assert (merging.weights[k.replace(".base_layer", "")] - v).abs().max() <= 1e-6, k
    with pytest.raises(KeyError, match="adapter tensor 'nowhere.lora_A.weight'"):
        sync.merge_lora(base.state_dict(), {"nowhere.lora_A.weight": torch.zeros(1, 1)}, 1.0)


# ----------------------------------------------------------------------------- transports


def test_in_process_transport():
    trainer = random_weights()
    rx = Receiver({k: torch.zeros_like(v) for k, v in trainer.items()})
    sender = Sender(trainer, mode="full")
    for _ in range(2):
        trainer["small"] += 1
        assert sync.send_local(sender.make_update(), rx).checksum() == sender.checksum()


WORKER = """
import json, os, sys, torch, torch.distributed as dist
import sync
dist.init_process_group("gloo")
rank, out = dist.get_rank(), {"checksums": [], "bytes": []}
g = torch.Generator().manual_seed(0)
w = {"a": torch.randn(200, 100, generator=g), "b": torch.randn(77, generator=g)}
if rank == 0:
    sender = sync.Sender(w, dtype=torch.bfloat16)
else:
    rx = sync.Receiver({k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in w.items()})
for step in range(3):
    w["a"][step, :10] += 1.0
    u = sender.make_update() if rank == 0 else None
    if step < 2:
        u = sync.broadcast_update(u, src=0)
    elif rank == 0:
        sync.send_update(u, dst=1)
    else:
        u = sync.recv_update(src=0)
    if rank == 0:
        out["checksums"].append(sender.checksum()); out["bytes"].append(sender.stats()["bytes"])
    else:
        out["checksums"].append(rx.apply(u).checksum())
json.dump(out, open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w"))
dist.destroy_process_group()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_distributed_broadcast_gloo(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port, procs = free_port(), []
    for rank in range(2):  # what torchrun sets up, without its agent's start-up time
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port),
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out
    finally:  # a rank that hangs in a collective must not outlive the test
        for p in procs:
            if p.poll() is None:
                p.kill()
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["checksums"] == r1["checksums"] and len(r0["checksums"]) == 3
    full = 200 * 100 * 2 + 77 * 2
    assert r0["bytes"][0] == full and 0 < r0["bytes"][1] < full // 10
    print(f"\n[sync] gloo broadcast: bytes shipped per step {r0['bytes']} (full {full})")


KILLED_WRITER = """
import sys, torch, sync
w = {f"t{i}": torch.randn(64, 1024) for i in range(8)}  # 8 shards of 256 KiB
u = sync.Sender(w, mode="full").make_update(version=2)
sync.FileTransport(sys.argv[1], shard_bytes=256 << 10, pause_between_shards=60).publish(u)
"""


def test_file_transport_survives_a_writer_killed_mid_write(tmp_path):
    folder = str(tmp_path / "sync")
    trainer = {f"t{i}": torch.randn(64, 1024) for i in range(8)}
    sender, ft = Sender(trainer, mode="full"), FileTransport(folder, shard_bytes=256 << 10)
    ft.publish(sender.make_update())
    assert FileTransport(folder).latest().version == 1
    manifest = ft.manifest(1)
    assert (manifest["kind"] == "full" and len(manifest["shards"]) == 8
            and manifest["checksum"] == sender.checksum())
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, str(script), folder], env=env, cwd=ROOT)
    tmp = os.path.join(folder, "updates", ".tmp-v000002")
    try:
        deadline = time.time() + 60
        # the first shard in place (not its own temp file, mid-save): the writer now sleeps
        while not (os.path.isdir(tmp) and any(f.startswith("shard-") for f in os.listdir(tmp))
                   ) and time.time() < deadline:
            assert p.poll() is None, "the writer exited before it was killed"
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)  # mid-write: it sleeps after each shard
        p.wait()
    # a half-written update is on disk...
    assert os.listdir(tmp) == ["shard-00001-of-00008.safetensors"]
    reader = FileTransport(folder)
    # ...and ignored
    assert reader.versions() == [1] and reader.latest().version == 1 and reader.poll(1) == []
    rx = Receiver({k: torch.zeros_like(v) for k, v in trainer.items()})
    for u in reader.poll(0):
        rx.apply(u)
    assert rx.checksum() == sender.checksum()
    ft.publish(sender.make_update(full=True))  # the next publish clears the leftovers
    assert not os.path.exists(tmp) and reader.latest().version == 2


def test_file_transport_delta_chain_and_pruning(tmp_path):
    trainer = random_weights()
    zeros = lambda: Receiver({k: torch.zeros_like(v) for k, v in trainer.items()})  # noqa: E731
    sender, ft, rx = Sender(trainer), FileTransport(str(tmp_path), keep=3), zeros()
    for step in range(3):
        trainer["big"][step, :7] -= 1
        ft.publish(sender.make_update())
    assert [(u.kind, u.version) for u in ft.poll(0)] == [("full", 1), ("delta", 2), ("delta", 3)]
    for u in ft.poll(rx.version):
        rx.apply(u)
    for step in range(2):
        trainer["mid"][step] += 1
        ft.publish(sender.make_update())
    assert ft.versions() == [3, 4, 5]  # keep=3 pruned v1 and v2
    for u in ft.poll(rx.version):
        rx.apply(u)
    assert rx.version == 5 and rx.checksum() == sender.checksum()
    late, ups = zeros(), ft.poll(0)
    with pytest.raises(ValueError,
                       match="v2->v3 needs the receiver on version 2, but it is on version 0"):
        late.apply(ups[0])  # its chain was pruned: it needs a full update
    ft.publish(sender.make_update(full=True))
    assert [u.version for u in ft.poll(0)] == [6]  # deltas before the newest full update are moot
    late.apply(ft.latest())
    assert late.checksum() == sender.checksum()
