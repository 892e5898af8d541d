"""
bench/gpu.py: stage 2 on one GPU, in one command that needs only torch, triton, numpy, transformers
and this repository (no flash-attn, no datasets, no network). Its sections, in one table:
    (a) the Triton kernel against its PyTorch reference, in fp32, bf16 and fp16: max abs error;
    (b) the kernel (1/8 of the pages) against SDPA (dense) and FlexAttention (the same block mask),
        at 8k and 32k cached tokens, with the bandwidth each reaches on the bytes it reads;
    (c) the engine's decode tokens/s, dense against 1/8 of the pages, on a Qwen3-1.7B-shaped model
        with random weights, and the lossless row: the 1/8 budget drafts 8 tokens with the Triton
        kernel, the dense policy verifies them with SDPA over each row's pages;
    (d) stage 4's 2:4 path: a 2:4-masked bf16 weight as PyTorch's semi-structured sparse tensor
        (torch.sparse.to_sparse_semi_structured; compute capability 8.0 or more) against the same
        masked weight dense, on Qwen3-1.7B's Linear shapes, at decode (32 rows) and prefill (4,096
        rows) sizes; without such a GPU it is one "skipped" row;
    (f) the engine's greedy tokens against transformers' greedy `generate` on the same weights, in
        fp32 and bf16: rows identical, tokens agreeing before the first difference, tokens/s;
    (g) five RL steps of train.py on a random-weight Qwen3-0.6B-shaped model in bf16, with the
        character tokenizer (tasks.py) built offline: dense, sparse decode (1/4 of the pages) and
        speculative (spec_k 8 over the same sparse budget): step time, peak GPU memory, and
        whether every loss and gradient norm is finite.

    python -m bench gpu                    # on a GPU: a few minutes; prints and writes the table
    python -m bench gpu --quick            # toy sizes; on a CPU through Triton's interpreter (CI)

The table goes to out/bench_gpu.md (and, with --write-results, to bench/RESULTS.md).

Simplifications:
    1. Random weights and random caches: speed does not depend on the values. The selection is
       Sparrow-like (the first page, the two most recent, random others), not a scorer's.
    2. Times are triton.testing.do_bench's on a GPU; on a CPU (the smoke run) they time the
       interpreter and mean nothing but that the code runs.
    3. Bandwidth counts the K and V bytes of the valid tokens read (the kernel and flex: the
       selected pages; SDPA: every page), not the queries or the outputs.
    4. (c) decodes greedily with EOS off after one shared prompt per group, so both arms produce
       the same number of tokens; the sparse arm's first two layers are dense. The speculative
       arm samples at temperature 1 (greedy drafts of a random model tie), also to max length.
    5. (d) times one F.linear per shape, weights random and magnitude-masked 2:4 (sparsity.nm_mask);
       its error is the semi-structured output's max abs difference from masked dense, relative to
       the largest output. A shape the sparse path rejects is reported as such, not dropped.
    6. (f) and (g) use random weights: near-tied logits make greedy paths part early in bf16, so
       (f)'s bf16 agreement is a floor, and (g)'s reward is the completion's length parity
       (parity_rewards), since a random policy solves nothing and a group with no spread trains
       nothing. (g)'s step time leaves out step 0 (Triton compiles there).
"""

import contextlib
import math
import os
import tempfile
import time

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: E402

import reward  # noqa: E402
import train  # noqa: E402
from bench.common import _Ids, best_of, hardware  # noqa: E402
from zeros_kernels.block_sparse_decode import (  # noqa: E402
    _bytes_read, _make_problem, block_sparse_decode, block_sparse_decode_ref)
from model import ModelConfig, Transformer  # noqa: E402
from rollout import Engine  # noqa: E402
from sparsity import fraction_budget, nm_mask  # noqa: E402
from tasks import build_char_tokenizer  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def timer(dev):
    """Milliseconds of one call of fn: do_bench on a GPU, one wall-clock call elsewhere."""
    if dev == "cuda":
        return triton.testing.do_bench

    def once(fn):
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)

    return once


def correctness(dev, quick):
    """(a): rows of the kernel's max abs error against the reference, per dtype."""
    rows = []
    shape = (2, 2, 2, 16, 8, 64, 3) if quick else (8, 8, 2, 128, 16, 4096, 32)
    for dtype, tol in TOLERANCE.items():
        p = _make_problem(*shape, dtype, dev)
        err = (block_sparse_decode(*p).float() - block_sparse_decode_ref(*p).float()).abs().max()
        rows.append(f"| (a) kernel vs reference, {str(dtype)[6:]} | max abs err {err.item():.2e} | "
                    f"tolerance {tol:g} | {'ok' if err.item() <= tol else 'FAIL'} |")
    return rows


def flex_inputs(q, k_cache, v_cache, page_table, seq_lens, sel, n_sel):
    """The unpaged (B, H_kv, T, D) copies that SDPA and flex read, and flex's block mask over the
    same logical pages (one KV block per page; the G queries of a group as G query positions of
    one head, since flex's per-head block mask and GQA do not combine in its decode path)."""
    B, H_kv, P, max_pages = q.shape[0], k_cache.shape[2], k_cache.shape[1], page_table.shape[1]
    G, D = q.shape[1] // H_kv, q.shape[2]
    kc = k_cache[page_table.long()].flatten(1, 2).transpose(1, 2).contiguous()
    vc = v_cache[page_table.long()].flatten(1, 2).transpose(1, 2).contiguous()
    kv_indices = torch.zeros(B, H_kv, 1, max_pages, dtype=torch.int32, device=q.device)
    kv_indices[..., :sel.shape[2]] = sel[:, :, None]
    mask = BlockMask.from_kv_blocks(n_sel[..., None].contiguous(), kv_indices,
                                    BLOCK_SIZE=(128, P), seq_lengths=(G, max_pages * P),
                                    compute_q_blocks=False,
                                    mask_mod=lambda b, h, q_idx, kv_idx: kv_idx < seq_lens[b])
    return kc, vc, mask, q.view(B, H_kv, G, D)


def kernel_vs_dense(dev, quick):
    """(b): the kernel at 1/8 of the pages, SDPA dense, flex sparse: ms and GB/s, per context."""
    ms, rows = timer(dev), []
    flex = torch.compile(flex_attention, dynamic=False)  # eager flex is a slow reference (and was
    # seen to mis-read a small block mask on the CPU): compiled, as it is meant to run
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    for ctx in ((64,) if quick else (8192, 32768)):
        B, H_kv, G, D, P = (1, 2, 2, 16, 8) if quick else (16, 8, 2, 128, 16)
        p = _make_problem(B, H_kv, G, D, P, ctx, max(4, ctx // P // 8), dtype, dev)
        q, read = p[0], _bytes_read(p[1], *p[3:])  # K and V bytes of the selected pages
        kc, vc, mask, qg = flex_inputs(*p)
        ref = block_sparse_decode_ref(*p).float()
        flex_err = (flex(qg, kc, vc, block_mask=mask).reshape(ref.shape).float() - ref).abs().max()
        arms = {"kernel, 1/8 of the pages": (lambda: block_sparse_decode(*p), read),
                "SDPA, dense": (lambda: F.scaled_dot_product_attention(q[:, :, None], kc, vc,
                                                                       enable_gqa=True),
                                2 * kc.numel() * kc.element_size()),
                "FlexAttention, same pages": (lambda: flex(qg, kc, vc, block_mask=mask), read)}
        for name, (fn, nbytes) in arms.items():
            fn()  # compile and warm up
            t = ms(fn)
            rows.append(f"| (b) {name}, {ctx} tokens, batch {B} | {t:.3f} ms | "
                        f"{nbytes / t / 1e6:.0f} GB/s | flex err {flex_err.item():.1e} |")
    return rows


def engine_decode(dev, quick):
    """(c): decode tokens/s of the engine, dense vs 1/8 of the pages, same model and prompts."""
    torch.manual_seed(0)
    if quick:
        cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          max_position_embeddings=512)
        prompt, G, n_prompts, new = 96, 2, 2, 8
    else:  # Qwen3-1.7B's shape
        cfg = ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128, max_position_embeddings=40960)
        prompt, G, n_prompts, new = 8192, 8, 4, 256
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = Transformer(cfg).to(dev, dtype).eval()
    tok = type("Ids", (), {"pad_token_id": 0, "eos_token_id": None,
                           "batch_decode": lambda self, rows, **k: ["" for _ in rows]})()
    prompts = [torch.randint(3, cfg.vocab_size, (prompt,)).tolist() for _ in range(n_prompts)]
    rate, acc = {}, 0.0
    arms = (("dense", False, 0), ("1/8", fraction_budget(1 / 8), 0),
            ("speculative", fraction_budget(1 / 8), 8))
    for name, budget, k in arms:  # greedy; the speculative arm samples at T = 1 (a random
        # model's greedy drafts tie), so its dense reference is the dense arm's rate
        eng = Engine(model, tok, max_new_tokens=new, temperature=1.0 if k else 0.0, sparse=budget,
                     eos_ids=[-1], speculative=k)
        with torch.no_grad():
            eng.generate(prompts[:1], 1, seed=0)  # warm up (and compile the kernel)
            t = eng.generate(prompts, G, seed=0).timings
        rate[name], acc = t["new_tokens"] / t["decode_s"], t.get("acceptance", acc)
    head = f"| (c) engine decode, {n_prompts} x {G} rows, {prompt}-token prompts, {new} new"
    return [f"{head} | dense {rate['dense']:.0f} tok/s | 1/8 {rate['1/8']:.0f} tok/s | "
            f"{rate['1/8'] / rate['dense']:.2f}x |",
            f"{head}, lossless: the 1/8 draft (Triton kernel), k = 8, verified densely (SDPA over "
            f"each row's pages) | dense {rate['dense']:.0f} tok/s | speculative "
            f"{rate['speculative']:.0f} tok/s, acceptance {acc:.3f} | "
            f"{rate['speculative'] / rate['dense']:.2f}x |"]


# Qwen3-1.7B's Linear shapes (out, in): q_proj and o_proj; k_proj and v_proj; gate and up; down
SEMI_SHAPES = {"q/o_proj": (2048, 2048), "k/v_proj": (1024, 2048), "gate/up_proj": (6144, 2048),
               "down_proj": (2048, 6144)}


def semi_structured(dev, quick):
    """(d): 2:4 as a semi-structured sparse tensor against the same 2:4-masked weight stored dense:
    ms per F.linear, the ratio, and the sparse output's error. One skip row without a GPU of
    compute capability 8.0 or more."""
    cap = torch.cuda.get_device_capability() if dev == "cuda" else None
    if cap is None or cap < (8, 0):
        why = "no GPU" if cap is None else f"compute capability {cap[0]}.{cap[1]} < 8.0"
        return [f"| (d) 2:4 semi-structured vs masked dense | skipped: {why} | | |"]
    from torch.sparse import to_sparse_semi_structured
    ms, rows = timer(dev), []
    shapes = {"toy": (256, 256)} if quick else SEMI_SHAPES
    for tokens in ((64,) if quick else (32, 4096)):
        for name, (out_f, in_f) in shapes.items():
            torch.manual_seed(0)
            w = torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16)
            w = w * nm_mask(w, 2, 4)
            x = torch.randn(tokens, in_f, device=dev, dtype=torch.bfloat16)
            what = f"| (d) 2:4 {name} {out_f}x{in_f}, {tokens} rows"
            try:
                ws = to_sparse_semi_structured(w)
                ref, got = F.linear(x, w).float(), F.linear(x, ws).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                t_dense, t_sparse = ms(lambda: F.linear(x, w)), ms(lambda: F.linear(x, ws))
            except (RuntimeError, ValueError, NotImplementedError) as e:
                rows.append(f"{what} | sparse path failed: {str(e).splitlines()[0][:80]} | | |")
                continue
            rows.append(f"{what} | masked dense {t_dense:.4f} ms | semi-structured "
                        f"{t_sparse:.4f} ms | {t_dense / t_sparse:.2f}x, rel err {err:.1e} |")
    return rows


# Qwen3-0.6B's shape (its vocabulary, tied embeddings); TOY: the smoke run's
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=40960, tie_word_embeddings=True)
TOY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)


def agreement(ours, theirs):
    """'r/B rows identical, a% of tokens before the first difference' for two (B, T) greedy
    outputs."""
    same = (ours == theirs).int()
    before = same.cumprod(1).sum(1)  # per row: tokens agreeing before the first difference
    return (f"{int((before == same.shape[1]).sum())}/{same.shape[0]} rows identical, "
            f"{before.sum().item() / same.numel():.0%} of tokens before the first difference")


def engine_vs_transformers(dev, quick):
    """(f): the engine against transformers' greedy generate on the same saved weights and
    prompts, in fp32 and bf16 (EOS off, the same lengths): agreement and tokens/s of each."""
    from transformers import AutoModelForCausalLM  # seconds to import: only here
    torch.manual_seed(0)
    cfg = ModelConfig(**(TOY if quick else QWEN3_06B))
    batch, prompt, new = (2, 8, 8) if quick else (8, 64, 128)
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt),
                        generator=torch.Generator().manual_seed(0))
    rows, out = [], {}
    with tempfile.TemporaryDirectory() as d:
        Transformer(cfg).save_pretrained(d)
        for dtype in (torch.float32, torch.bfloat16):
            model = Transformer.from_pretrained(d, dtype=dtype, device=dev).eval()
            hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(dev).eval()
            eng = Engine(model, _Ids(), max_new_tokens=new, temperature=0.0, eos_ids=[])
            x = ids.to(dev)

            @torch.no_grad()
            def run_hf():
                out["hf"] = hf.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                        max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[:, prompt:].cpu()
            t = best_of({"ours": lambda: out.update(ours=eng.generate(ids.tolist(), 1).tokens),
                         "hf": run_hf}, repeats=1)
            rows.append(f"| (f) engine vs transformers generate, {str(dtype)[6:]}, batch {batch}, "
                        f"{new} new | {agreement(out['ours'].cpu(), out['hf'])} | "
                        f"ours {batch * new / t['ours']:.0f} tok/s, transformers "
                        f"{batch * new / t['hf']:.0f} tok/s | {t['hf'] / t['ours']:.2f}x |")
            del model, hf, eng
    return rows


@contextlib.contextmanager
def parity_rewards():
    """(g)'s reward, while the block runs: the cascade scores as usual (its time counts), then
    each completion's reward becomes its length's parity. A random policy never writes an answer
    the cascade's cheap checks let through, and a group with no spread trains nothing."""
    score = reward.Cascade.score_batch

    def parity(self, problems, texts, *args, **kw):
        res = score(self, problems, texts, *args, **kw)
        res.rewards = [float(len(t) % 2) for t in texts]
        return res
    reward.Cascade.score_batch = parity
    try:
        yield
    finally:
        reward.Cascade.score_batch = score


# (g)'s arms: train.py overrides on top of rl_run_args
RL_ARMS = {"dense": [],
           "sparse decode": ["--kv_budget=fraction:0.25"],
           "speculative": ["--kv_budget=fraction:0.25", "--rollout_mode=speculative", "--spec_k=8"]}


def rl_run_args(folder, out_dir, dev, quick):
    """train.py's arguments for (g): the saved random model in bf16, the synthetic task, no plot,
    evaluation only at the start and the end."""
    steps, per_step, group, new = (2, 2, 2, 16) if quick else (5, 8, 8, 256)
    return [f"--model={folder}", "--task=synthetic", "--dtype=bfloat16", f"--device={dev}",
            f"--steps={steps}", f"--prompts_per_step={per_step}", f"--group_size={group}",
            f"--max_new_tokens={new}", "--n_train=256", f"--n_eval={4 if quick else 16}",
            "--eval_every=1000", "--save_every=1000", "--plot=false", "--lr=1e-6",
            "--warmup_steps=0", "--chat_template=false",
            f"--micro_batch={4 if quick else 16}", f"--out_dir={out_dir}"]


def rl_steps(dev, quick):
    """(g): train.py's RL steps on a random-weight model, dense, sparse and speculative: mean step
    time (rollout + update), peak GPU memory, and whether every loss and gradient norm is
    finite."""
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        folder = os.path.join(d, "model")
        Transformer(ModelConfig(**(TOY if quick else QWEN3_06B))).save_pretrained(folder)
        build_char_tokenizer(folder)  # offline: one token per character
        for arm, extra in RL_ARMS.items():
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with parity_rewards():
                recs = train.main(rl_run_args(folder, os.path.join(d, arm), dev, quick)
                                  + extra)["records"]
            timed = recs[1:] or recs  # step 0 compiles
            gen = sum(r["gen_s"] for r in timed) / len(timed)
            learn = sum(r.get("train_s", 0.0) for r in timed) / len(timed)
            finite = all(math.isfinite(r.get(k, 0.0)) for r in recs for k in ("loss", "grad_norm"))
            trained = sum(r.get("tokens", 0) for r in recs)
            mem = (f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if dev == "cuda"
                   else "peak memory: no GPU")
            rows.append(f"| (g) {len(recs)} RL steps, {arm}, bf16 | step {gen + learn:.2f} s "
                        f"(rollout {gen:.2f}, update {learn:.2f}) | {mem} | "
                        f"{'finite' if finite else 'NOT FINITE'} loss and grad norms, "
                        f"{trained} tokens trained |")
    return rows


def run(quick, cmd):
    """-> the table, head included; also written to out/bench_gpu.md."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hw = hardware(gpu=dev == "cuda")
    lines = [f"Hardware: {hw}. Command: `{cmd}`." + ("" if dev == "cuda" else
             " No GPU: Triton's interpreter at toy sizes, a smoke run (times mean nothing)."), "",
             "| what | figure | figure | note |", "|---|---|---|---|"]
    for part in (correctness, kernel_vs_dense, engine_decode, semi_structured,
                 engine_vs_transformers, rl_steps):
        lines += part(dev, quick)
    os.makedirs("out", exist_ok=True)
    with open(os.path.join("out", "bench_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines
