"""
bench.py: side-by-side measurements. Every figure is a ratio of two things timed in the same run on the same
machine, printed as a markdown table whose rows name the hardware and the command.

    python bench.py rollout --threads 1       # stage 2: the rollout engine (about 8 minutes on one CPU core)
    python bench.py rollout --quick           # smaller sizes: a smoke run of the same code (under a minute)
    python bench.py rollout --write-readme    # also rewrite README.md between <!-- bench:rollout --> markers

    python bench.py signal --write-readme     # stages 1 and 3: 5 seeds x 4 short default runs (about 30 minutes)
    python bench.py sparrow --write-readme    # stage 2 in the loop: five long-CoT runs, and assets/sparrow.png
    python bench.py sparsecost --threads 1    # stage 2: where a long-CoT decode step's time goes (about 4 minutes)

Sections (one function each, `bench_<name>`; later stages add theirs):
    signal   the embedded default with growth-zone and dynamic sampling against uniform sampling that trains on
             every group, at the same number of rollouts: zero-advantage groups trained on, completions that
             reach the expensive verifier, held-out accuracy
    rollout  (a) tokens/s of our engine against transformers' `generate`, same weights, batch and lengths
             (b) prefill work and time for a group of G = 8 rollouts of one long prompt, shared vs per rollout
             (c) one decode step's attention, sparse (1/8 of the pages) vs dense, on the CPU path
             (d) on a GPU only: the Triton kernel vs SDPA dense decode vs FlexAttention on the same pages,
                 and the bandwidth each reaches as a fraction of the device's peak
             (e) the cost model (sparsity.rollout_cost) next to the engine: predicted and measured decode
                 speedup of a sparse schedule on this machine, and the prediction for Qwen3-1.7B on an H200
    sparrow  the miniature Sparrow experiment on configs/longcot.py, from one warm start, seed and step count:
             (a) dense, (b) a fixed aggressive budget, (c) the p5-held schedule, (d) (c) + DistillSparse,
             (e) (b) + DistillSparse;
             reward, held-out accuracy, mean and p5 alpha per bin, pages read, rollout time, in-run speedup
    sparsecost the same task's decode, dense, at a fixed 8 pages, at the calibrated table and at the table that
             the oracle scorer calibrates, split into attention, page selection and the rest: the speedup each
             reaches and the ceiling its read fraction allows

Simplifications:
    1. The model is random: speed does not depend on the weights. Decoding is greedy with EOS off, so both
       sides of a comparison generate exactly the same number of tokens.
    2. A time is the best of a few runs after a warm-up (the minimum is the least noisy estimate of the cost);
       the two sides of a ratio take turns, so a drifting machine load hits both. The longest generations
       run once, without a warm-up.
    3. Peak bandwidth comes from a small table of datasheet numbers keyed by device name; an unknown device
       gets no fraction.
    4. On a machine shared with other work, `--threads 1` gives steadier numbers than several threads that
       wait on each other; the table records the thread count.
"""

import argparse
import dataclasses
import os
import platform
import sys
import tempfile
import time

import torch

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
PEAK_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "RTX 4090": 1.008e12}


# ----------------------------------------------------------------------------- helpers


def hardware(gpu=False):
    """Where a row was measured: '<cpu model>, <n> cores, <t> threads', or the GPU's name."""
    if gpu:
        return torch.cuda.get_device_name(0)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def best_of(fns, repeats, warmup=1):
    """{name: fn} -> {name: minimum wall time of fn()}. The functions take turns, so a machine whose load
    drifts during the run slows both sides of a ratio alike. Syncs the GPU around each run."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def row(figure, ours, base, ratio, target, hw, cmd):
    return f"| {figure} | {ours} | {base} | {ratio:.2f}x | {target} | {hw} | `{cmd}` |"


TABLE_HEAD = ["| figure | ours | baseline | ratio | target | hardware | command |",
              "|---|---|---|---|---|---|---|"]


def write_readme_block(section, text, path=README):
    """Replace what lies between `<!-- bench:<section> -->` and `<!-- /bench:<section> -->` in path.
    Returns False (and writes nothing) when the file or a marker is missing."""
    start, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    if not os.path.exists(path):
        return False
    with open(path) as f:
        doc = f.read()
    a, b = doc.find(start), doc.find(end)
    if a < 0 or b < a:
        return False
    with open(path, "w") as f:
        f.write(doc[:a + len(start)] + "\n" + text + "\n" + doc[b:])
    return True


class _Ids:
    """The engine needs a tokenizer only for the pad and EOS ids and to decode texts, which nobody reads here."""
    pad_token_id, eos_token_id = 0, None

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["" for _ in rows]


def bench_model(max_len):
    """A ~12M-parameter Qwen3-shaped model: big enough that the forward, not Python, sets the pace on a CPU."""
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=max_len)
    return Transformer(cfg).eval()


# ----------------------------------------------------------------------------- stage 2: rollout


def rollout_vs_transformers(model, lengths, batch, prompt_len, hw, cmd):
    """(a) Tokens/s of Engine.generate against transformers' generate on the same weights, dense and greedy."""
    from transformers import AutoModelForCausalLM
    from rollout import Engine
    rows = []
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.randint(2, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    for n in lengths:
        eng = Engine(model, _Ids(), max_new_tokens=n, temperature=0.0, eos_ids=[])
        out = {}

        @torch.no_grad()
        def run_hf():
            out["hf"] = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        t = best_of({"ours": lambda: out.setdefault("ours", eng.generate(ids.tolist(), 1)), "hf": run_hf},
                    repeats=1 if n >= 1024 else 2, warmup=0 if n >= 1024 else 1)
        same = (out["ours"].tokens == out["hf"][:, prompt_len:]).float().mean().item()
        toks = batch * n
        rows.append(row(f"(a) greedy generation, batch {batch}, prompt {prompt_len}, {n} new tokens, dense "
                        f"({same:.0%} of tokens identical)", f"{toks / t['ours']:.0f} tok/s",
                        f"{toks / t['hf']:.0f} tok/s (transformers)", t["hf"] / t["ours"],
                        ">= 2x at 1,024" if n >= 1024 else "", hw, cmd))
        print(rows[-1], flush=True)
    return rows


def rollout_shared_prefill(model, prompt_len, G, hw, cmd):
    """(b) Prefill of a group of G rollouts of one prompt: shared (once) against once per rollout."""
    from rollout import Engine
    prompt = torch.randint(2, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1))
    ros = {True: [], False: []}
    engines = {share: Engine(model, _Ids(), max_new_tokens=1, temperature=0.0, eos_ids=[], share_prefix=share)
               for share in ros}
    best_of({share: (lambda s=share: ros[s].append(engines[s].generate([prompt.tolist()], G))) for share in ros},
            repeats=3)
    t_s, t_n = (min(r.timings["prefill_s"] for r in ros[s]) for s in (True, False))
    n_s, n_n = (ros[s][-1].timings["prefill_tokens"] for s in (True, False))
    out = [row(f"(b) prefill tokens, G = {G} rollouts of a {prompt_len}-token prompt", f"{n_s}",
               f"{n_n} (each rollout prefilled)", n_n / n_s, f"exactly {G}x", hw, cmd),
           row(f"(b) prefill wall time, same group", f"{t_s * 1e3:.0f} ms", f"{t_n * 1e3:.0f} ms", t_n / t_s,
               f">= {0.8 * G:.1f}x", hw, cmd)]
    print("\n".join(out), flush=True)
    return out


def paged_problem(B, H_kv, G, D, ctx, page_size, dtype, device, seed=0):
    """Full-length sequences in a shuffled paged pool, with every page's mean key: what a decode step sees.
    Made on the device itself (a 128k-token pool is gigabytes)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n = -(-ctx // page_size)
    k = torch.randn(B * n, page_size, H_kv, D, generator=gen, device=device).to(dtype)
    v = torch.randn(B * n, page_size, H_kv, D, generator=gen, device=device).to(dtype)
    table = torch.randperm(B * n, generator=gen, device=device).view(B, n).to(torch.int32)
    q = torch.randn(B, H_kv * G, D, generator=gen, device=device).to(dtype)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    return q, k, v, table, lens, k.float().mean(1)  # kmean (num_pages, H_kv, D)


def sparse_step(q, k, v, table, lens, kmean, fraction, keep_first=1, keep_recent=2):
    """Select `fraction` of the pages (centroid scores, sink and recent kept): the engine's per-layer work."""
    from sparsity import centroid_scores, fraction_budget, pages_to_read, select_pages
    B, P = table.shape
    n_read = pages_to_read(fraction_budget(fraction), P, P, keep_first, keep_recent)
    counts = torch.full((B,), P, device=q.device)
    scores = centroid_scores(q, kmean[table.long()])  # (B, H_kv, P)
    return select_pages(scores, counts, counts, torch.full_like(counts, n_read), keep_first, keep_recent, n_read)


def rollout_sparse_decode_cpu(contexts, B, H_q, H_kv, D, page_size, hw, cmd):
    """(c) One decode step's attention on the CPU path (the PyTorch reference), 1/8 of the pages vs all."""
    from kernels.block_sparse_decode import decode_attention
    rows = []
    for ctx in contexts:
        q, k, v, table, lens, kmean = paged_problem(B, H_kv, H_q // H_kv, D, ctx, page_size, torch.float32, "cpu")
        sel, n_sel = sparse_step(q, k, v, table, lens, kmean, 1 / 8)
        t = best_of({"dense": lambda: decode_attention(q, k, v, table, lens),
                     "attn": lambda: decode_attention(q, k, v, table, lens, sel, n_sel),
                     "both": lambda: decode_attention(q, k, v, table, lens, *sparse_step(q, k, v, table, lens,
                                                                                         kmean, 1 / 8))}, repeats=5)
        t_dense, t_attn, t_both = t["dense"], t["attn"], t["both"]
        shape = f"B={B}, Hq={H_q}, Hkv={H_kv}, D={D}, fp32, pages of {page_size}"
        rows.append(row(f"(c) decode attention, {ctx // 1024}k context, 1/8 of the pages vs all ({shape})",
                        f"{t_attn * 1e3:.1f} ms; {t_both * 1e3:.1f} ms with page scoring and selection "
                        f"({t_dense / t_both:.1f}x)", f"{t_dense * 1e3:.1f} ms (dense)", t_dense / t_attn,
                        ">= 4x at 16k" if ctx >= 16384 else "", hw, cmd))
        print(rows[-1], flush=True)
        del q, k, v, table, kmean
    return rows


def rollout_sparse_decode_gpu(contexts, B, H_q, H_kv, D, page_size, hw, cmd, device="cuda"):
    """(d) The Triton kernel (dense and 1/8 of the pages) against SDPA dense decode on an unpaged copy, and
    FlexAttention on the same pages; bf16, with the bandwidth each reaches."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    from kernels.block_sparse_decode import block_sparse_decode, block_sparse_decode_ref, dense_selection
    peak = next((bw for name, bw in PEAK_BYTES_PER_S.items() if name in hw), None)
    flex = torch.compile(flex_attention, dynamic=False)
    G, rows = H_q // H_kv, []
    for ctx in contexts:
        q, k, v, table, lens, kmean = paged_problem(B, H_kv, G, D, ctx, page_size, torch.bfloat16, device)
        sel, n_sel = sparse_step(q, k, v, table, lens, kmean, 1 / 8)
        dsel, dn = dense_selection(table, lens, H_kv, page_size)
        P = table.shape[1]
        kc = k[table.long()].flatten(1, 2).transpose(1, 2).contiguous()  # (B, H_kv, T, D) for SDPA and flex
        vc = v[table.long()].flatten(1, 2).transpose(1, 2).contiguous()
        # flex: one KV block per page; the G queries of a group go in as G query positions of one head,
        # because flex's per-head block mask and GQA do not combine in its decoding kernel
        idx = torch.zeros(B, H_kv, 1, P, dtype=torch.int32, device=device)
        idx[..., :sel.shape[2]] = sel[:, :, None]
        mask = BlockMask.from_kv_blocks(n_sel[..., None].contiguous(), idx, BLOCK_SIZE=(128, page_size),
                                        seq_lengths=(G, P * page_size), compute_q_blocks=False)
        qg = q.view(B, H_kv, G, D)
        runs = {"kernel sparse": lambda: block_sparse_decode(q, k, v, table, lens, sel, n_sel),
                "kernel dense": lambda: block_sparse_decode(q, k, v, table, lens, dsel, dn),
                "SDPA dense": lambda: F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True),
                "flex sparse": lambda: flex(qg, kc, vc, block_mask=mask)}
        ref = block_sparse_decode_ref(q, k, v, table, lens, sel, n_sel).float()
        for name in ("kernel sparse", "flex sparse"):
            err = (runs[name]().reshape(B, H_q, D).float() - ref).abs().max().item()
            assert err < 3e-2, f"{name} differs from the reference by {err} at {ctx} tokens"
        t = best_of(runs, repeats=20, warmup=3)
        kv_bytes = 2 * B * H_kv * D * k.element_size() * page_size  # K and V bytes of one page, all rows
        nbytes = {"kernel sparse": kv_bytes * sel.shape[2], "flex sparse": kv_bytes * sel.shape[2],
                  "kernel dense": kv_bytes * P, "SDPA dense": kv_bytes * P}

        def bw(name):
            rate = nbytes[name] / t[name]
            return f"{t[name] * 1e6:.0f} us, {rate / 1e12:.2f} TB/s" + (f" ({rate / peak:.0%} of peak)" if peak else "")
        shape = f"{ctx // 1024}k context, B={B}, Hq={H_q}, Hkv={H_kv}, D={D}, bf16"
        rows += [row(f"(d) kernel 1/8 pages vs SDPA dense, {shape}", bw("kernel sparse"), "SDPA " + bw("SDPA dense"),
                     t["SDPA dense"] / t["kernel sparse"], "", hw, cmd),
                 row(f"(d) kernel 1/8 pages vs FlexAttention on the same pages, {shape}", bw("kernel sparse"),
                     "flex " + bw("flex sparse"), t["flex sparse"] / t["kernel sparse"], "", hw, cmd),
                 row(f"(d) kernel dense vs SDPA dense, {shape}", bw("kernel dense"), "SDPA " + bw("SDPA dense"),
                     t["SDPA dense"] / t["kernel dense"], "", hw, cmd)]
        print("\n".join(rows[-3:]), flush=True)
        del q, k, v, kc, vc
    return rows


def machine_rates(n=2048, nbytes=256 << 20, repeats=3):
    """This machine's sustained fp32 FLOP/s (an n x n matmul) and read bandwidth in bytes/s (summing nbytes of
    fp32), best of `repeats`: the two rates that the cost model divides by."""
    a, b, x = torch.randn(n, n), torch.randn(n, n), torch.ones(nbytes // 4)
    t = best_of({"matmul": lambda: a @ b, "sum": lambda: x.sum()}, repeats=repeats)
    return 2 * n ** 3 / t["matmul"], nbytes / t["sum"]


def cost_model_check(model, L_in, L_out, N, schedule, dense_layers, rates, page_size=16, repeats=2):
    """One group of N rows sharing an L_in-token prompt, L_out new tokens each: decode seconds measured with the
    engine (dense and with `schedule`, best of `repeats`) and predicted by sparsity.rollout_cost for the same
    shape, schedule and lengths from rates = (FLOP/s, bytes/s). The engine's first token comes from prefill, so
    decode runs L_out - 1 forwards with L_in + 1 ... L_in + L_out - 1 tokens cached: exactly rollout_cost's
    steps for L_out - 1 tokens. Prefill is the same dense work on both sides and is left out of both."""
    from rollout import Engine
    from sparsity import model_shape, rollout_cost
    cfg = model.config
    prompt = torch.randint(2, cfg.vocab_size, (L_in,), generator=torch.Generator().manual_seed(2)).tolist()
    keep = dict(page_size=page_size, dense_layers=dense_layers, keep_first=1, keep_recent=2)
    engines = {"dense": Engine(model, _Ids(), max_new_tokens=L_out, temperature=0.0, eos_ids=[], **keep),
               "sparse": Engine(model, _Ids(), max_new_tokens=L_out, temperature=0.0, eos_ids=[], sparse=schedule,
                                **keep)}
    ros = {k: [] for k in engines}
    best_of({k: (lambda k=k: ros[k].append(engines[k].generate([prompt], N))) for k in engines}, repeats, warmup=0)
    measured = {k: min(r.timings["decode_s"] for r in ros[k]) for k in ros}
    P, layers, kv_heads, head_dim = model_shape(cfg)
    # fp32 everywhere on a CPU: 4-byte KV, and every step re-reads the 4-byte weights
    pred = rollout_cost(P, layers, N, cfg.num_attention_heads // kv_heads, 2 * layers * kv_heads * head_dim, L_in,
                        L_out - 1, *rates, schedule=schedule, kv_bytes=4, param_bytes=4, **keep)
    t = ros["sparse"][-1].timings
    return {"measured": measured, "pred": pred, "pages": t["pages_read"] / t["pages_dense"],
            "speedup": measured["dense"] / measured["sparse"]}


def rollout_cost_vs_measured(hw, cmd, quick):
    """(e) sparsity.rollout_cost against the engine on this CPU: predicted vs measured decode speedup and seconds
    for 1/8 of the pages; then what the model predicts for Qwen3-1.7B on an H200 (a prediction only)."""
    from model import ModelConfig, Transformer
    from sparsity import fraction_budget, model_shape, rollout_cost
    flops, bw = machine_rates()
    # narrow, shallow and KV-heavy (D = 3,072 KV elements a token against ~7M weights): attention over a long
    # prompt is most of a decode step, so the schedule has something to save
    L_in, L_out, N, dl = (1024, 64, 4, 2) if quick else (2048, 128, 4, 2)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                    max_position_embeddings=L_in + L_out)).eval()
    c = cost_model_check(model, L_in, L_out, N, fraction_budget(1 / 8), dl, (flops, bw))
    m, p = c["measured"], c["pred"]
    setup = (f"N = {N} rows of one {L_in}-token prompt, {L_out} new tokens, 1/8 of the pages past {dl} dense layers "
             f"(engine read {c['pages']:.0%} of the dense pages), 6 layers, Hq 8, Hkv 4, head_dim 64, fp32; "
             f"rates {flops / 1e9:.0f} GFLOP/s (matmul), {bw / 1e9:.1f} GB/s (sum)")
    rows = [row(f"(e) cost model: decode speedup predicted vs measured, {setup}", f"{p['speedup']:.2f}x predicted",
                f"{c['speedup']:.2f}x measured", p["speedup"] / c["speedup"], "", hw, cmd)]
    for k in ("dense", "sparse"):
        # the model reads the prompt's KV once a step for all N rows; the CPU path gathers every row's pages,
        # the shared prompt's included, into an fp32 copy before attention (the largest item in a profile at
        # 2k tokens, then the attention bmm, the N-row matmuls far below the big-matmul rate and elementwise
        # ops): it under-predicts the seconds several-fold, dense more than sparse
        rows.append(row(f"(e) cost model: {k} decode seconds predicted vs measured, same run (the model counts "
                        f"FLOPs and bytes at the measured rates; the CPU path re-gathers the shared prompt's KV "
                        f"per row and runs small matmuls below peak)", f"{p[k + '_s']:.2f} s predicted",
                        f"{m[k]:.2f} s measured", p[k + "_s"] / m[k], "", hw, cmd))
    # Qwen3-1.7B (tied embeddings) on an H200's datasheet rates, bf16: a prediction, nothing is run
    qwen = ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    P, layers, kv_heads, head_dim = model_shape(qwen)
    args = (P, layers, 8, 16 // kv_heads, 2 * layers * kv_heads * head_dim, 1024, 16384, 989e12, 4.8e12)
    q = rollout_cost(*args, schedule=fraction_budget(1 / 8), dense_layers=2, kv_bytes=2)
    qw = rollout_cost(*args, schedule=fraction_budget(1 / 8), dense_layers=2, kv_bytes=2, param_bytes=2)
    rows.append(row(f"(e) cost model PREDICTION (not measured): Qwen3-1.7B, N = 8 rollouts of a 1,024-token prompt, "
                    f"16,384 new tokens, 1/8 of the pages past 2 dense layers, bf16; with the weights' traffic (2 "
                    f"bytes a parameter a step, which the formula leaves out) added: {qw['sparse_s']:.0f} s sparse "
                    f"vs {qw['dense_s']:.0f} s dense, {qw['speedup']:.2f}x", f"{q['sparse_s']:.1f} s sparse",
                    f"{q['dense_s']:.1f} s dense", q["speedup"], "", "H200 datasheet: 989 TFLOP/s bf16, 4.8 TB/s",
                    cmd))
    print("\n".join(rows), flush=True)
    return rows


def bench_rollout(quick, cmd):
    """Stage 2. (a) and (b) run the engine on the CPU, (c) times the CPU attention path, (d) needs CUDA."""
    hw = hardware()
    print("\n".join(TABLE_HEAD), flush=True)
    model = bench_model(max_len=4096)
    rows = rollout_vs_transformers(model, [32, 64] if quick else [256, 1024], batch=8, prompt_len=32, hw=hw, cmd=cmd)
    rows += rollout_shared_prefill(model, 256 if quick else 1024, G=8, hw=hw, cmd=cmd)
    del model
    rows += rollout_sparse_decode_cpu([1024, 4096] if quick else [4096, 16384], B=4, H_q=16, H_kv=8, D=128,
                                      page_size=16, hw=hw, cmd=cmd)
    if torch.cuda.is_available():
        rows += rollout_sparse_decode_gpu([8192, 32768] if quick else [8192, 32768, 131072], B=8, H_q=16, H_kv=8,
                                          D=128, page_size=16, hw=hardware(gpu=True), cmd=cmd)
    rows += rollout_cost_vs_measured(hw, cmd, quick)
    return rows


def run_summary(history):
    """What one training run spent and kept, from its per-step records."""
    recs = history["records"]
    n = sum(r["rollouts"] for r in recs)
    trained = sum(r["groups_kept"] for r in recs)
    share = lambda k: sum(r.get(k, 0.0) * r["rollouts"] for r in recs) / max(1, n)  # of every completion of the run
    return {"rollouts": n, "zero_adv": sum(r["zero_adv_groups"] for r in recs) / max(1, trained),
            "verify": share("reach_verify"), "by_value": share("by_value"),
            "acc0": history["acc0"], "acc": [r["acc"] for r in recs if "acc" in r][-1], "steps": len(recs)}


SIGNAL_VARIANTS = {"with refills": [], "without refills": ["--refill_tries=0"]}  # ours, as dynamic sampling is set


def bench_signal(quick, cmd):
    """Stages 1 and 3: growth-zone sampling with dynamic sampling (ours) against uniform sampling that trains on
    every group (baseline), at the same number of rollouts, from the same warm start, for seeds 0 to 4 (a seed
    sets the warm start, the pools and the sampling). The embedded default, stopped at 12 of its 60 steps and
    scored on 500 held-out problems: at 60 steps both arms reach 0.98-1.00, which compares nothing. Ours runs
    twice, as the default (refilled up to refill_tries = 2 times) and without refills (refill_tries = 0: groups
    without spread are dropped and the step trains short), each against its own rollout-matched baseline."""
    import shutil
    import train
    hw = hardware()
    seeds = (0,) if quick else (0, 1, 2, 3, 4)
    args = ["--plot=false", "--eval_every=1000"] + (["--steps=6", "--sft_steps=60", "--n_eval=50"] if quick
                                                    else ["--steps=12", "--n_eval=500"])
    rows = []
    root = tempfile.mkdtemp(prefix="zeros-bench-signal-")
    try:
        for seed in seeds:  # the warm start (SFT) of each seed, shared by every run of it, outside the timing
            cfg = train.parse_config(args + [f"--seed={seed}", f"--out_dir={root}/{seed}"])
            train.build_policy(cfg, torch.device("cpu"), print)
        for variant, ours_args in SIGNAL_VARIANTS.items():
            runs, wall = {"ours": [], "base": []}, {"ours": 0.0, "base": 0.0}
            for seed in seeds:
                a = args + [f"--seed={seed}"]
                for arm in ("ours", "base"):
                    if arm == "ours":
                        extra = ours_args
                    else:  # as many steps as ours' rollouts make: the same number of rollouts
                        same = max(1, round(runs["ours"][-1]["rollouts"] / (cfg.prompts_per_step * cfg.group_size)))
                        extra = ["--sampler=uniform", "--dynamic_sampling=false", f"--steps={same}"]
                    out = f"{root}/{seed}-{variant}-{arm}".replace(" ", "_")
                    shutil.copytree(f"{root}/{seed}/warmstart", f"{out}/warmstart")
                    t = time.perf_counter()
                    runs[arm].append(run_summary(train.main(a + [f"--out_dir={out}"] + extra)))
                    wall[arm] += time.perf_counter() - t
            rows += signal_rows(runs, wall, seeds, train.parse_config(args).steps, variant, hw, cmd)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in rows:
        print(r, flush=True)
    return rows


def signal_rows(runs, wall, seeds, steps, variant, hw, cmd):
    o, b = runs["ours"], runs["base"]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)

    def cell(rs, k, f):  # the mean over seeds, then each seed's value
        return format(mean(rs, k), f) + (" (" + ", ".join(format(r[k], f) for r in rs) + ")" if len(rs) > 1 else "")

    def spent(rs):  # one phrase when every seed spent the same
        each = [f"{r['rollouts']} in {r['steps']} steps" for r in rs]
        return "; ".join(each) if len(set(each)) > 1 else each[0] + (" per seed" if len(rs) > 1 else "")

    n_o, n_b = sum(r["rollouts"] for r in o), sum(r["rollouts"] for r in b)
    sub = f"growth zone + dynamic sampling {variant} vs uniform, every group trained"
    per = f"mean over seeds {', '.join(map(str, seeds))} (each seed)" if len(seeds) > 1 else f"seed {seeds[0]}"
    v = f"[{variant}] "
    return [f"| {v}rollouts generated ({sub}; {per}) | {spent(o)} | {spent(b)} | {n_o / n_b:.2f}x | equal | {hw} "
            f"| `{cmd}` |",
            f"| {v}trained groups with zero advantage | {cell(o, 'zero_adv', '.1%')} | {cell(b, 'zero_adv', '.1%')} | "
            f"| <= 5% | {hw} | `{cmd}` |",
            f"| {v}completions that reach the expensive verifier (math-verify) | {cell(o, 'verify', '.1%')} | "
            f"{cell(b, 'verify', '.1%')} | | <= 50% | {hw} | `{cmd}` |",
            f"| {v}completions whose answer fails the string match but is settled as an integer (without that rule, "
            f"they would reach the verifier) | {cell(o, 'by_value', '.1%')} | {cell(b, 'by_value', '.1%')} | | | {hw} | "
            f"`{cmd}` |",
            f"| {v}held-out greedy accuracy after ours' {steps} steps, warm start {cell(o, 'acc0', '.3f')} | "
            f"{cell(o, 'acc', '.3f')} | {cell(b, 'acc', '.3f')} | {mean(o, 'acc') - mean(b, 'acc'):+.3f} | "
            f"at least as good | {hw} | `{cmd}` |",
            f"| {v}wall time, warm starts not counted | {wall['ours']:.0f} s | {wall['base']:.0f} s | "
            f"{wall['ours'] / wall['base']:.2f}x | | {hw} | `{cmd}` |"]


# ----------------------------------------------------------------------------- stage 2 in the loop: Sparrow

SPARROW_FIXED = 8  # pages of 8 tokens per decode step for arm (b): below what calibration asks of the later bins


def sparrow_arms(fixed):
    return {"(a) dense": ["--kv_budget=dense", "--kv_controller=false"],
            f"(b) fixed {fixed} pages": [f"--kv_budget=table:{fixed}", "--kv_controller=false", "--kv_compare_every=5"],
            "(c) p5-held schedule": ["--kv_budget=calibrate", "--kv_controller=true", "--kv_compare_every=5"],
            "(d) (c) + DistillSparse": ["--kv_budget=calibrate", "--kv_controller=true", "--kv_compare_every=5",
                                        "--distill_r=8"],
            "(e) (b) + DistillSparse": [f"--kv_budget=table:{fixed}", "--kv_controller=false", "--kv_compare_every=5",
                                        "--distill_r=8"]}


def sparrow_summary(history):
    """One arm's figures from its per-step records."""
    recs = history["records"]
    def nanmean(xs):  # the mean of the values that are not NaN (empty bins, steps without a measurement)
        v = [x for x in xs if x == x]
        return sum(v) / len(v) if v else float("nan")

    bins = [r["alpha_bins"] for r in recs if "alpha_bins" in r]
    nb = max((len(b["p5"]) for b in bins), default=0)
    per_bin = {k: [nanmean([b[k][i] for b in bins if i < len(b[k])]) for i in range(nb)] for k in ("mean", "p5")}
    k = max(1, len(recs) // 5)
    speed = [r["rollout_speedup"] for r in recs if "rollout_speedup" in r]
    return {"reward0": nanmean([r["reward"] for r in recs[:k]]), "reward1": nanmean([r["reward"] for r in recs[-k:]]),
            "acc0": history["acc0"], "acc": [r["acc"] for r in recs if "acc" in r][-1],
            "alpha": nanmean([r["alpha_mean"] for r in recs]), "p5": nanmean([r["alpha_p5"] for r in recs]),
            "bins": per_bin, "kv_read": nanmean([r["kv_read"] for r in recs]),
            "gen_s": sum(r["gen_s"] for r in recs), "tokens": sum(r["new_tokens"] for r in recs),
            "speedup": nanmean(speed), "n_speed": len(speed), "table": recs[-1].get("kv_table"),
            "curve": [(r["step"], r["reward"], r.get("acc")) for r in recs]}


def sparrow_plot(results, path, threshold):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for i, (name, s) in enumerate(results.items()):
        c = f"C{i}"  # one colour per run in every panel
        steps = [x[0] for x in s["curve"]]
        ax[0].plot(steps, [x[1] for x in s["curve"]], color=c, label=name)
        ev = [(x[0], x[2]) for x in s["curve"] if x[2] is not None]
        ax[1].plot([-1] + [e[0] for e in ev], [s["acc0"]] + [e[1] for e in ev], color=c, marker="o", label=name)
        if s["bins"]["p5"]:
            ax[2].plot(range(len(s["bins"]["p5"])), s["bins"]["p5"], color=c, marker="o", label=f"{name}: p5")
            ax[2].plot(range(len(s["bins"]["mean"])), s["bins"]["mean"], color=c, ls="--", label=f"{name}: mean")
    ax[2].axhline(threshold, color="k", lw=0.8, ls=":")
    for a, t in zip(ax, ("training reward", "held-out greedy accuracy", "alpha per bin of cached length")):
        a.set_title(t)
        a.legend(fontsize=7)
    ax[0].set_xlabel("step"), ax[1].set_xlabel("step (-1: the warm start)")
    ax[2].set_xlabel("bin of cached length; dotted: the threshold")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bench_sparrow(quick, cmd):
    """The miniature Sparrow experiment on the CPU long-CoT task (configs/longcot.py): five runs from the same warm
    start, seed and steps, (a) dense, (b) a fixed aggressive budget, (c) the p5-held schedule (calibrated at the
    start, then the controller), (d) (c) with DistillSparse, (e) (b) with DistillSparse: what the adapter does to
    the tail at a budget that misses the threshold. Writes assets/sparrow.png and the table."""
    import shutil
    import train
    hw = hardware()
    args = ["configs/longcot.py", "--plot=false"] + (["--steps=4", "--sft_steps=40", "--n_eval=16", "--eval_every=2",
                                                      "--calib_prompts=4"] if quick else [])
    root = tempfile.mkdtemp(prefix="zeros-bench-sparrow-")
    cfg = train.parse_config(args)
    results = {}
    cached = os.path.join(cfg.out_dir, "warmstart")  # a warm start that `python train.py configs/longcot.py` built
    try:
        for i, (name, extra) in enumerate(sparrow_arms(SPARROW_FIXED).items()):
            out = f"{root}/arm{i}"
            src = f"{root}/arm0/warmstart" if i else cached
            if os.path.isdir(src):  # one warm start for every arm (train.warm_start rebuilds it if its key differs)
                shutil.copytree(src, f"{out}/warmstart")
            print(f"--- {name}", flush=True)
            results[name] = sparrow_summary(train.main(args + extra + [f"--out_dir={out}"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs("assets", exist_ok=True)
    sparrow_plot(results, "assets/sparrow.png", cfg.kv_target)
    dense_ms = 1e3 * results["(a) dense"]["gen_s"] / results["(a) dense"]["tokens"]
    rows = []
    for name, s in results.items():
        fmt_bins = lambda xs: " ".join("-" if x != x else f"{x:.2f}" for x in xs) or "-"
        ms = 1e3 * s["gen_s"] / s["tokens"]
        rows.append(f"| {name} | {s['reward0']:.3f} -> {s['reward1']:.3f} | {s['acc0']:.3f} -> {s['acc']:.3f} | "
                    f"{s['alpha']:.3f} / {s['p5']:.3f} | {fmt_bins(s['bins']['mean'])} | {fmt_bins(s['bins']['p5'])} | "
                    f"{s['kv_read']:.2f} | {ms:.2f} ms ({dense_ms / ms:.2f}x) | "
                    + (f"{s['speedup']:.2f}x ({s['n_speed']} steps)" if s["n_speed"] else "-")
                    + f" | {s['table'] or '-'} |")
    head = [f"Hardware: {hw}. Command: `{cmd}`. {cfg.steps} steps, {cfg.prompts_per_step} x {cfg.group_size} "
            f"rollouts per step, threshold p5 alpha >= {cfg.kv_target}, bins of {cfg.kv_bin_pages} pages of "
            f"{cfg.page_size} tokens, first {cfg.dense_layers} layer(s) dense.", "",
            "| run | reward, first -> last fifth of the steps | held-out accuracy, start -> end | alpha mean / p5 "
            "(all tokens) | mean alpha per bin | p5 alpha per bin | KV pages read (of dense) | rollout time per "
            "token (vs the dense run) | rollout speedup vs dense, same step, same weights | table at the end |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    return head + rows


# ----------------------------------------------------------------------------- stage 2: where decode time goes

def bench_sparsecost(quick, cmd):
    """Where a decode step's time goes on the CPU long-CoT task (configs/longcot.py's warm start, built if missing,
    and its rollout shape), dense and sparse: the same prompts generated dense, at a fixed 8 pages, at the
    calibrated p5-held table, and at the table calibrated with the oracle scorer (the true attention mass per
    page: about the fewest pages a query-aware scorer can hold the threshold with; it reads every key, so its time
    is no speedup), with the engine's attention calls (gather + SDPA) and page selections timed. The
    ceiling is what the read fraction r allows when selection is free and the rest of the step is unchanged:
    1 / ((1 - s) + s * r), s the attention share of the dense decode time. The arms take turns, three rounds with
    the same seed (the same tokens); each arm's fastest run counts."""
    import shutil
    import rollout
    import train
    from sparsity import Schedule
    hw = hardware()
    root = tempfile.mkdtemp(prefix="zeros-bench-sparsecost-")  # the quick run's warm start, the calibration files
    cfg = train.parse_config(["configs/longcot.py"] + (["--sft_steps=20", "--calib_prompts=2", "--max_new_tokens=64",
                                                        f"--out_dir={root}/quick"] if quick else []))
    dev = torch.device("cpu")
    model, tok = train.build_policy(cfg, dev, print)
    pool, _ = train.load_problems(cfg)
    pool, ids = train.encode_pool(tok, pool, cfg, model.config.max_position_embeddings, print)
    n = 2 if quick else cfg.prompts_per_step
    prompts = [ids[i] for i in range(n)]
    clock = {"attn": 0.0, "select": 0.0}

    def timed(name, fn):
        def wrapped(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            clock[name] += time.perf_counter() - t
            return out
        return wrapped

    real_attn, real_select = rollout.decode_attention, rollout.PagedKVCache._select
    rollout.decode_attention = timed("attn", real_attn)
    rollout.PagedKVCache._select = timed("select", real_select)  # called in attend, before decode_attention
    try:
        for sc in (cfg.kv_scorer, "oracle"):
            os.makedirs(f"{root}/{sc}")
        calib = {sc: train.kv_budget(dataclasses.replace(cfg, kv_budget="calibrate", kv_scorer=sc,
                                                         out_dir=f"{root}/{sc}"), model, tok, ids, print)
                 for sc in (cfg.kv_scorer, "oracle")}
        arms = {"dense": (False, cfg.kv_scorer),
                f"fixed {SPARROW_FIXED} pages": (Schedule([SPARROW_FIXED], cfg.kv_bin_pages), cfg.kv_scorer),
                f"calibrated table {calib[cfg.kv_scorer].table}": (calib[cfg.kv_scorer], cfg.kv_scorer),
                f"oracle scorer (reads every key), its calibrated table {calib['oracle'].table}":
                    (calib["oracle"], "oracle")}
        engines = {name: rollout.Engine(model, tok, cfg.max_new_tokens, cfg.temperature, cfg.top_p, [cfg.stop],
                                        sparse=budget, page_size=cfg.page_size, scorer=scorer,
                                        dense_layers=cfg.dense_layers) for name, (budget, scorer) in arms.items()}
        for eng in engines.values():
            eng.generate(prompts[:1], cfg.group_size, seed=1)  # warm-up
        res = {}
        for _ in range(1 if quick else 3):  # the arms take turns; the same seed draws the same tokens each time
            for name, eng in engines.items():
                clock.update(attn=0.0, select=0.0)
                t = eng.generate(prompts, cfg.group_size, seed=0).timings
                if name not in res or t["decode_s"] < res[name]["decode"]:  # keep each arm's fastest run
                    res[name] = dict(tok=t["new_tokens"], decode=t["decode_s"], attn=clock["attn"],
                                     select=clock["select"], read=t["pages_read"] / max(1, t["pages_dense"]))
        for name, r in res.items():
            print(name, r, flush=True)
    finally:
        rollout.decode_attention, rollout.PagedKVCache._select = real_attn, real_select
        shutil.rmtree(root, ignore_errors=True)
    d = res["dense"]
    share = d["attn"] / d["decode"]
    ms = lambda r, k: 1e3 * r[k] / r["tok"]
    rows = [f"Hardware: {hw}. Command: `{cmd}`. {n} prompts x {cfg.group_size} rollouts of the long-CoT warm start, "
            f"sampled, up to {cfg.max_new_tokens} new tokens, pages of {cfg.page_size}, first {cfg.dense_layers} "
            f"layer(s) dense. Dense decode spends {share:.0%} of its time in attention.", "",
            "| decode | KV pages read (of dense) | decode ms per token | attention (gather + SDPA) | page selection "
            "| the rest | speedup vs dense (per token) | ceiling at this read fraction, selection free |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        rows.append(f"| {name} | {r['read']:.2f} | {ms(r, 'decode'):.3f} | {ms(r, 'attn'):.3f} | {ms(r, 'select'):.3f}"
                    f" | {ms(r, 'decode') - ms(r, 'attn') - ms(r, 'select'):.3f} | "
                    f"{ms(d, 'decode') / ms(r, 'decode'):.2f}x | {1 / ((1 - share) + share * r['read']):.2f}x |")
    return rows


SECTIONS = {"rollout": bench_rollout, "signal": bench_signal, "sparrow": bench_sparrow, "sparsecost": bench_sparsecost}
OWN_HEADER = {"sparrow", "sparsecost"}  # sections whose rows carry their own table head


def main(argv):
    p = argparse.ArgumentParser(description="side-by-side measurements, printed as a markdown table")
    p.add_argument("section", choices=sorted(SECTIONS))
    p.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run")
    p.add_argument("--write-readme", action="store_true", help="rewrite the section's marked block of README.md")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default); on a busy "
                   "machine 1 thread is steadier than several that wait on each other")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = SECTIONS[args.section](args.quick, " ".join(["python bench.py"] + argv))
    table = "\n".join(rows if args.section in OWN_HEADER else TABLE_HEAD + rows)
    print("\n" + table)
    if args.write_readme:
        if write_readme_block(args.section, table):
            print(f"README.md: rewrote the {args.section} block")
        else:
            print(f"README.md has no <!-- bench:{args.section} --> ... <!-- /bench:{args.section} --> block: "
                  f"printed only")


if __name__ == "__main__":
    main(sys.argv[1:])
