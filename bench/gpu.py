"""
bench/gpu.py: stage 2 on one GPU, in one command that needs only torch, triton, numpy, transformers
and this repository (no flash-attn, no datasets, no network). Its sections, in one table:
    (a) the Triton kernel against its PyTorch reference, in fp32, bf16 and fp16: max abs error;
    (b) the kernel (1/8 of the pages) against SDPA (dense) and FlexAttention (the same block mask),
        at 8k and 32k cached tokens, with the bandwidth each reaches on the bytes it reads;
    (c) the engine's decode tokens/s, dense against 1/8 of the pages, on a Qwen3-1.7B-shaped model
        with random weights, and the lossless row: the 1/8 budget drafts 8 tokens with the Triton
        kernel, the dense policy verifies them with SDPA over each row's pages; and the decode
        step captured as a CUDA graph per bucket (decode.py, step=auto) against the eager step,
        dense and at 1/8, with the capture's seconds apart and the greedy tokens compared;
    (d) stage 4's 2:4 path: a 2:4-masked bf16 weight as PyTorch's semi-structured sparse tensor
        (torch.sparse.to_sparse_semi_structured; compute capability 8.0 or more) against the same
        masked weight dense, on Qwen3-1.7B's Linear shapes, at decode (32 rows) and prefill (4,096
        rows) sizes; without such a GPU it is one "skipped" row;
    (f) the engine's greedy tokens against transformers' greedy `generate` on the same weights, in
        fp32 and bf16: rows identical, tokens agreeing before the first difference, tokens/s;
    (g) five RL steps of train.py at configs/countdown_qwen3.py's shapes (32 prompts x 8 rows,
        1,024 new tokens, its micro-batch, fp32 weights under bf16 autocast) on a random-weight
        Qwen3-0.6B-shaped model with the character tokenizer (tasks.py), all built offline:
        dense, sparse decode (1/4 of the pages) and speculative (spec_k 8 over the same sparse
        budget): step time beside the cost model's floor (step_cost, at this GPU's measured
        rates), peak GPU memory (torch.cuda.max_memory_allocated) beside memory.py's prediction,
        and whether every loss and gradient norm is finite.

    python -m bench gpu                    # on a GPU (not timed on one yet); prints, writes a table
    python -m bench gpu --quick            # toy sizes; on a CPU through Triton's interpreter (CI)

Each row is printed and appended to out/bench_gpu.md as soon as it is measured, so a part that
crashes (or a run cut short) keeps the rows before it; a part that raises writes a row with its
error, in one line, and the next part runs. With --write-results the table also goes to
bench/RESULTS.md.

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
    7. (g)'s prompts are countdown's questions in the character tokenizer, one token a character
       (about 400 tokens against about 130 in Qwen3's own); memory.py predicts at that length.
"""

import contextlib
import dataclasses
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

import memory  # noqa: E402
import reward  # noqa: E402
import train  # noqa: E402
from bench.common import _Ids, best_of, hardware  # noqa: E402
from bench.cost import machine_rates, model_shape as cost_shape, rollout_cost  # noqa: E402
from config import parse_config  # noqa: E402
from zeros_kernels.block_sparse_decode import (  # noqa: E402
    block_sparse_decode, block_sparse_decode_ref)
from zeros_kernels.block_sparse_bench import bytes_read, make_problem  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from rollout import Engine  # noqa: E402
from sparsity import fraction_budget, nm_mask  # noqa: E402
from tasks import build_char_tokenizer, encode_pool, load_problems  # noqa: E402

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
    shape = (2, 2, 2, 16, 8, 64, 3) if quick else (8, 8, 2, 128, 16, 4096, 32)
    for dtype, tol in TOLERANCE.items():
        p = make_problem(*shape, dtype, dev)
        err = (block_sparse_decode(*p).float() - block_sparse_decode_ref(*p).float()).abs().max()
        yield (f"| (a) kernel vs reference, {str(dtype)[6:]} | max abs err {err.item():.2e} | "
               f"tolerance {tol:g} | {'ok' if err.item() <= tol else 'FAIL'} |")


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
    ms = timer(dev)
    flex = torch.compile(flex_attention, dynamic=False)  # eager flex is a slow reference (and was
    # seen to mis-read a small block mask on the CPU): compiled, as it is meant to run
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    for ctx in ((128,) if quick else (8192, 32768)):
        # pages of 16 tokens at the least: compiled flex on the CPU (torch 2.13) reads a KV block
        # of 8 wrong, about 2 off the reference
        B, H_kv, G, D, P = (1, 2, 2, 16, 16) if quick else (16, 8, 2, 128, 16)
        p = make_problem(B, H_kv, G, D, P, ctx, max(4, ctx // P // 8), dtype, dev)
        q, read = p[0], bytes_read(p[1], *p[3:])  # K and V bytes of the selected pages
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
            yield (f"| (b) {name}, {ctx} tokens, batch {B} | {t:.3f} ms | "
                   f"{nbytes / t / 1e6:.0f} GB/s | flex err {flex_err.item():.1e} |")


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
    rate, acc, capture, tokens = {}, 0.0, {}, {}
    eighth = fraction_budget(1 / 8)
    arms = (("dense", False, 0, "auto"), ("1/8", eighth, 0, "auto"),
            ("speculative", eighth, 8, "auto"), ("dense eager", False, 0, "eager"),
            ("1/8 eager", eighth, 0, "eager"))
    for name, budget, k, step in arms:  # greedy; the speculative arm samples at T = 1 (a random
        # model's greedy drafts tie), so its dense reference is the dense arm's rate. step "auto":
        # the decode step captured as a CUDA graph per bucket (decode.py); "eager": its reference
        eng = Engine(model, tok, max_new_tokens=new, temperature=1.0 if k else 0.0, sparse=budget,
                     eos_ids=[-1], speculative=k, step=step)
        with torch.no_grad():
            eng.generate(prompts[:1], 1, seed=0)  # warm up (and compile the kernel)
            ro = eng.generate(prompts, G, seed=0)
        t, tokens[name] = ro.timings, ro.tokens
        rate[name], acc = t["new_tokens"] / t["decode_s"], t.get("acceptance", acc)
        capture[name] = t.get("compile_s", 0.0)  # capturing the buckets' graphs, not in decode_s
    head = f"| (c) engine decode, {n_prompts} x {G} rows, {prompt}-token prompts, {new} new"
    yield (f"{head} | dense {rate['dense']:.0f} tok/s | 1/8 {rate['1/8']:.0f} tok/s | "
           f"{rate['1/8'] / rate['dense']:.2f}x |")
    yield (f"{head}, lossless: the 1/8 draft (Triton kernel), k = 8, verified densely (SDPA over "
           f"each row's pages) | dense {rate['dense']:.0f} tok/s | speculative "
           f"{rate['speculative']:.0f} tok/s, acceptance {acc:.3f} | "
           f"{rate['speculative'] / rate['dense']:.2f}x |")
    for arm in ("dense", "1/8"):  # on a CPU both run eagerly (no graph): a smoke row
        same = torch.equal(tokens[arm], tokens[arm + " eager"])  # greedy: the same tokens
        yield (f"{head}, {arm}: the decode step captured (step=auto, a CUDA graph per bucket) "
               f"against eager | captured {rate[arm]:.0f} tok/s | eager {rate[arm + ' eager']:.0f}"
               f" tok/s | {rate[arm] / rate[arm + ' eager']:.2f}x; capture {capture[arm]:.1f} s, "
               f"apart; tokens {'identical' if same else 'DIFFER'} |")


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
        yield f"| (d) 2:4 semi-structured vs masked dense | skipped: {why} | | |"
        return
    from torch.sparse import to_sparse_semi_structured
    ms = timer(dev)
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
                yield f"{what} | sparse path failed: {str(e).splitlines()[0][:80]} | | |"
                continue
            yield (f"{what} | masked dense {t_dense:.4f} ms | semi-structured "
                   f"{t_sparse:.4f} ms | {t_dense / t_sparse:.2f}x, rel err {err:.1e} |")


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
    out = {}
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
            yield (f"| (f) engine vs transformers generate, {str(dtype)[6:]}, batch {batch}, "
                   f"{new} new | {agreement(out['ours'].cpu(), out['hf'])} | "
                   f"ours {batch * new / t['ours']:.0f} tok/s, transformers "
                   f"{batch * new / t['hf']:.0f} tok/s | {t['hf'] / t['ours']:.2f}x |")
            del model, hf, eng


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
RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "countdown_qwen3.py")


def rl_run_args(folder, out_dir, dev, quick):
    """train.py's arguments for (g): configs/countdown_qwen3.py's shapes (prompts, rows, new
    tokens, micro-batch, precision) on the saved random model and its character tokenizer, the
    task's problems generated offline (a small pool), no plot, evaluation at the start and the
    end only. --quick: toy sizes."""
    toy = ["--prompts_per_step=2", "--group_size=2", "--max_new_tokens=16", "--micro_batch=2",
           "--logp_chunk=8"] if quick else []
    return [RECIPE, f"--model={folder}", f"--device={dev}", "--steps=5", "--n_train=64",
            f"--n_eval={4 if quick else 16}", "--eval_every=1000", "--save_every=1000",
            "--plot=false", "--warmup_steps=0", "--chat_template=false", f"--out_dir={out_dir}",
            *toy]


def step_cost(cfg, shape, prompt, flops, bandwidth):
    """The cost model's seconds for one step of `cfg` (one try, every row to max_new_tokens), a
    floor: no launch or Python overheads, every matmul at `flops`, every byte at `bandwidth`.
    Decode is bench/cost.py's rollout_cost per group (at a fraction:F budget, its sparse figure),
    plus the bf16 weights read once a step for all the rows (an MoE's experts as many as its rows
    pick); the update 6 FLOPs per parameter and token (2 forward, 4 backward; 4 under LoRA, whose
    frozen weights take no gradient), the head's over the scored positions only and once more
    for its recomputed chunks; prefill 2."""
    P, layers, kv_heads, hd = cost_shape(shape)
    D, r = 2 * layers * kv_heads * hd, shape.num_attention_heads // kv_heads
    kvb = 2 if cfg.kv_dtype != "float32" else 4
    # a fraction budget reads fewer pages; a speculative rollout verifies every token densely
    frac = cfg.kv_budget.startswith("fraction:") and cfg.rollout_mode != "speculative"
    one = rollout_cost(P, layers, cfg.group_size, r, D, prompt, cfg.max_new_tokens, flops,
                       bandwidth, kv_bytes=kvb, dense_layers=cfg.dense_layers,
                       schedule=fraction_budget(float(cfg.kv_budget[9:])) if frac else None,
                       page_size=cfg.page_size, keep_first=cfg.kv_keep_first,
                       keep_recent=cfg.kv_keep_recent)
    rows, head = cfg.prompts_per_step * cfg.group_size, shape.vocab_size * shape.hidden_size
    read = P  # the parameters a decode step reads: an MoE's experts that its rows pick
    if shape.num_experts:
        every = memory.count_params(dataclasses.replace(cfg, lora_r=0), shape)["all"]
        every -= 0 if shape.tie_word_embeddings else head  # the embedding is a lookup
        read = P + (every - P) * min(1.0, rows * shape.num_experts_per_tok / shape.num_experts)
    decode = (cfg.prompts_per_step * one["sparse_s" if frac else "dense_s"]
              + 2 * read * cfg.max_new_tokens / bandwidth)
    scored, body = rows * cfg.max_new_tokens, P - head
    tokens = cfg.prompts_per_step * prompt + scored  # shared prompts once
    per = 4 if cfg.lora_r else 6
    update = (per * body * tokens + (per + 2) * head * scored) * cfg.passes / flops
    return {"decode_s": decode, "prefill_s": 2 * P * cfg.prompts_per_step * prompt / flops,
            "update_s": update, "step_s": decode + update}


def gpu_rates(dev):
    """This device's matmul FLOP/s (bf16 on a GPU) and read bandwidth: the cost model's rates."""
    if dev != "cuda":
        return machine_rates(n=512, nbytes=32 << 20, repeats=1)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    x = torch.ones(1 << 28, device=dev)  # 1 GiB of fp32
    t_mm, t_sum = triton.testing.do_bench(lambda: a @ a), triton.testing.do_bench(x.sum)
    return 2 * 8192 ** 3 / (t_mm / 1e3), x.numel() * 4 / (t_sum / 1e3)


def predicted(args, dev):
    """memory.py's figure for a run of train.py `args` at the longest prompt of its pool (as the
    run encodes it), and the cost model's inputs: -> (Prediction, config, shape, longest prompt)."""
    from transformers import AutoTokenizer  # seconds to import: only here
    cfg = parse_config(args)
    shape = memory.model_shape(cfg)[0]  # the saved model's config.json
    tok = AutoTokenizer.from_pretrained(cfg.model)
    _, ids = encode_pool(tok, load_problems(cfg)[0], cfg, shape.max_position_embeddings,
                         log=lambda s: None)
    prompt = max(map(len, ids))
    return memory.predict(cfg, shape, prompt, device=dev), cfg, shape, prompt


def rl_steps(dev, quick):
    """(g): train.py's RL steps at configs/countdown_qwen3.py's shapes on a random-weight
    Qwen3-0.6B-shaped model, dense, sparse and speculative: mean step time (rollout + update)
    beside the cost model's floor, the peak GPU memory beside memory.py's figure, and whether
    every loss and gradient norm is finite. An arm that fails is a row with its error."""
    torch.manual_seed(0)
    rates = gpu_rates(dev)
    with tempfile.TemporaryDirectory() as d:
        folder = os.path.join(d, "model")
        Transformer(ModelConfig(**(TOY if quick else QWEN3_06B))).save_pretrained(folder)
        build_char_tokenizer(folder)  # offline: one token per character
        for arm, extra in RL_ARMS.items():
            what = f"| (g) 5 RL steps, {arm}, countdown_qwen3's shapes"
            try:
                yield f"{what}{rl_arm(dev, folder, os.path.join(d, arm), quick, extra, rates)}"
            except Exception as e:  # the row says why; the next arm runs
                yield f"{what} | FAILED: {one_line(e)} | | |"


def rl_arm(dev, folder, out_dir, quick, extra, rates):
    """One arm of (g): its row, past the first column."""
    args = rl_run_args(folder, out_dir, dev, quick) + extra
    pred, cfg, shape, prompt = predicted(args, dev)
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with parity_rewards():
        recs = train.main(args)["records"]
    timed = recs[1:] or recs  # step 0 compiles
    gen = sum(r["gen_s"] for r in timed) / len(timed)
    learn = sum(r.get("train_s", 0.0) for r in timed) / len(timed)
    finite = all(math.isfinite(r.get(k, 0.0)) for r in recs for k in ("loss", "grad_norm"))
    trained = sum(r.get("tokens", 0) for r in recs)
    cost = step_cost(cfg, shape, prompt, *rates)
    size = lambda x: f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"
    want = f"{size(pred.peak)} predicted by memory.py (its {pred.phase})"
    mem = (f"peak {size(torch.cuda.max_memory_allocated())} measured, {want}, "
           f"{pred.peak / torch.cuda.max_memory_allocated():.2f}x" if dev == "cuda"
           else f"peak: no GPU; {want}")
    return (f" ({cfg.prompts_per_step} x {cfg.group_size} rows, {cfg.max_new_tokens} new tokens, "
            f"micro-batch {cfg.micro_batch}, {cfg.dtype} + {cfg.autocast} autocast) | step "
            f"{gen + learn:.2f} s (rollout {gen:.2f}, update {learn:.2f}); the cost model's floor "
            f"{cost['step_s']:.3g} s | {mem} | {'finite' if finite else 'NOT FINITE'} loss and "
            f"grad norms, {trained} tokens trained |")


def one_line(e):
    """An exception as one line of a table cell."""
    text = f"{type(e).__name__}: {str(e).strip()}".splitlines()[0]
    return text.replace("|", "/")[:200]


# the table's parts in order: letter -> (what, a generator of its rows)
PARTS = {"a": ("kernel vs reference", correctness),
         "b": ("kernel vs SDPA and Flex", kernel_vs_dense),
         "c": ("engine decode", engine_decode), "d": ("2:4 semi-structured", semi_structured),
         "f": ("engine vs transformers", engine_vs_transformers), "g": ("RL steps", rl_steps)}


def run(quick, cmd):
    """-> the table, head included. Each row is printed and appended to out/bench_gpu.md as soon
    as it is measured; a part that fails writes a row with its error and the next part runs."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hw = hardware(gpu=dev == "cuda")
    lines = [f"Hardware: {hw}. Command: `{cmd}`." + ("" if dev == "cuda" else
             " No GPU: Triton's interpreter at toy sizes, a smoke run (times mean nothing)."), "",
             "| what | figure | figure | note |", "|---|---|---|---|"]
    os.makedirs("out", exist_ok=True)
    path = os.path.join("out", "bench_gpu.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)

    def emit(row):
        lines.append(row)
        print(row, flush=True)
        with open(path, "a") as f:  # written now: a later part that crashes keeps this row
            f.write(row + "\n")

    for letter, (name, part) in PARTS.items():
        try:
            for row in part(dev, quick):
                emit(row)
        except Exception as e:  # the error is the part's row; the table goes on
            emit(f"| ({letter}) {name} | FAILED: {one_line(e)} | | |")
    return lines
