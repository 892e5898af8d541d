"""
decode.py: stage 2, the decode step. One function, `decode_step`, makes one token for every row of
a round, with static shapes and no CPU-GPU sync, so that its forward can be compiled (CPU) or
captured as a CUDA graph (GPU); run eagerly it is the reference that both are held to. The engine
(rollout.Engine.decode) calls it for dense and sparse decoding, and speculative.py for the draft
steps of lossless sparse rollout.

    eng = Engine(model, tokenizer, sync_every=8, step="auto")   # the defaults
    call = eng.start(prompt_ids, group_size=8, seed=0)   # prefill, first tokens (rollout.py)
    while call.live:
        eng.decode(call, 8)        # 8 decode_steps of the live rows, then the host looks once
    ro = eng.finish(call)

    Engine(step="eager")     # the reference: the step's forward as plain PyTorch
    Engine(step="fused")     # CPU: each layer's work outside attention in two C++ calls
    Engine(step="compile")   # torch.compile of the forward, per bucket (compile time in timings)
    Engine(step="graph")     # CUDA: the forward captured per bucket, replayed (capture time too)
    python -m pytest tests/test_decode_step.py

What a step is (a round of them: Engine.decode):
    1. The host lays out a round once (PagedKVCache.begin_round): the live rows take the
       first slots of a bucket of B slots (1, 2, 4, 8, 16, then multiples of 16, at most the
       call's rows); pages are opened for the round's tokens; the slots' state (a `Slots`: rows,
       last tokens, cached lengths, completion positions, limits, live flags, page tables, the
       pages each page count reads) goes to the device in one copy. Padding slots write to the
       pool's scratch page and read nothing of anyone's.
    2. decode_step: `forward` (PagedKVCache.lay_step: the step's index tensors computed on the
       device from the slots' lengths; then the model over each slot's last token), the token
       drawn with keyed noise (speculative.Noise: a row's draw depends on the seed, the row and
       its position, not on its bucket or its neighbours), written into the call's buffers at
       (row, position), the finish checks on the device (EOS, the row's limit), and the slots'
       lengths and positions moved on in place. A finished slot rides along, writing nothing
       that is read, until the round ends.
    3. The host looks once a round (sync_every steps; the one CPU-GPU sync): it takes the
       round's tokens (Engine.take: EOS, stop strings, limits, as one token a step would),
       releases the finished rows' pages and lays the next round out. Stop strings are checked
       there, so a row that hits one decodes to the end of its round for nothing.

How it runs (`Runner`):
    eager    forward as written: the reference.
    fused    CPU: forward with each layer's norms, q|k|v, q/k norms, RoPE, o, MLP and residuals
             in two C++ calls around the engine's attention (zeros_kernels/layer_cpu.py), for
             fp32 dense models of plain linears (fused_refusals says why not). The default on
             a CPU: on bench/specdecode's 4-layer model, 8 rows of 1k-4k tokens, 1 thread, a
             dense step dispatches about 290 ops instead of 505 and runs 0.94-1.28x eager;
             torch.compile did not pay there (0.78x eager dense and 0.51x sparse at 1k, after
             19 s of compiling: each C++ call is a graph break).
    compile  torch.compile(forward, dynamic=False): one compilation per bucket (guards on the
             shapes), the C++ calls left as graph breaks; inductor fuses the small ops between.
    graph    CUDA: the first step of a bucket runs eagerly (warm-up: Triton compiles its
             kernel), then the forward is captured into a CUDA graph on a memory pool the
             buckets share; later steps copy nothing (the slots ARE the graph's inputs, updated
             in place) and replay. Sampling stays outside the graph (a few ops).
    auto     graph on CUDA where it is safe; fused on a CPU where the model allows; else eager.
A graph replays fixed memory: the slots (made once per bucket and page-table width, kept by
the engine), the KV pool's buffers and the weights. So capture is refused (eager runs) where the
forward would read anything else: record_pages (a list grows), MoE (its router syncs), rescoring
once in several steps (a host clock), autocast (its weight copies die with the context), and a
graph is captured again when the pool's buffers or the weights' storage change.

Simplifications:
    1. A round's bucket is fixed: a row that finishes inside it costs its slot to the round's
       end (at most sync_every - 1 steps); MoE rounds run one step (its router syncs and the
       host records its routes) with buckets of exactly the live rows.
    2. Sampling, top-k and the records run outside the captured graph, as eager ops (about 50
       a step): a graph of the whole step would need the call's buffers at fixed addresses.
    3. Eager on a CPU, the static step costs about as much as the host-laid step it replaced
       (PagedKVCache.begin_decode, kept as the tests' reference): its index arithmetic runs as
       device ops (about 60 more a step) where the host's lists did it in Python, and it looks
       at the rows once in sync_every steps instead of every step.
"""

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculative import draft_sample, sample, topk_logprobs
from zeros_kernels.layer_cpu import fused_refusals, model_forward

STEPS = ("auto", "eager", "fused", "compile", "graph")  # Engine(step=...), config key decode_step


def bucket(n, cap):
    """The slots of a round of n rows: the smallest of 1, 2, 4, 8, 16, 32, 48, 64, ... (powers
    of two, then multiples of 16, as nano-vllm's captured batch sizes) that holds n, at most
    cap (the call's rows)."""
    b = 1 << (n - 1).bit_length() if n <= 16 else -(-n // 16) * 16
    return min(b, cap)


@dataclass
class Slots:
    """A round's decode state on the device, a slot a row in a bucket of B slots (slots past the
    round's rows are padding): what decode_step reads and moves on in place, so that its shapes
    stay fixed for the bucket. Made once per (B, pages) and reused, so that a captured step
    replays on the same memory. PagedKVCache.begin_round fills it (the six int64 rows are views
    of one (6, B) tensor, `ints`: one copy a round); lay_step reads it."""
    ints: torch.Tensor  # (6, B) int64: rows, tok, lens, pos, limit, shared
    rows: torch.Tensor  # (B,) int64 the call's row in each slot (padding: N, the scratch row)
    tok: torch.Tensor  # (B,) int64 each slot's last token: the next forward's input
    lens: torch.Tensor  # (B,) int64 tokens cached: the position the input goes to
    pos: torch.Tensor  # (B,) int64 the completion position of the token the step samples
    limit: torch.Tensor  # (B,) int64 tokens the row may have (max_new_tokens, or its forced ones)
    live: torch.Tensor  # (B,) bool: not finished (a finished slot rides along to the round's end)
    shared: torch.Tensor  # (B,) int64 its shared prompt's tokens (lanes: the rest is its own)
    table: torch.Tensor  # (B, P) int32 page tables (padding: the scratch page)
    budget: torch.Tensor  # (2P + 2,) int64 pages a sparse step reads, at 2n + (last partial)
    read: torch.Tensor  # (L,) int64 pages the live slots' sparse selections read, all KV heads
    n: int = 0  # the round's rows: slots n.. are padding
    host_rows: list = None  # the rows of slots 0..n-1

    @classmethod
    def empty(cls, B, P, L, device):
        z = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)
        ints = z(6, B)
        rows, tok, lens, pos, limit, shared = ints.unbind(0)
        return cls(ints, rows, tok, lens, pos, limit, z(B, dtype=torch.bool), shared,
                   z(B, P, dtype=torch.int32), z(2 * P + 2), z(L))


@dataclass
class Call:
    """One generate call's state: the host's lists, and the device buffers that the decode steps
    write at (row, completion position); row N is the scratch row that padding and finished
    slots write to. T = max_new_tokens."""
    prompt_ids: list
    G: int
    groups: list  # [(prompt, rows)] per distinct prompt (Engine.groups)
    cache: object  # the call's PagedKVCache
    noise: object  # speculative.Noise of the call's seed
    out: list  # per row: the tokens taken (host ints)
    lps: list  # per row: their log-probs
    finish: list  # per row: "length" | "eos" | "stop"
    limit: list  # per row: tokens it may take (max_new_tokens, or its forced tokens)
    live: list  # rows still decoding
    tokens: torch.Tensor  # (N + 1, T) int64 sampled tokens
    # (N + 1, T, 3) fp32 per token: its log-prob, the pages its step read (sparse layers) and
    # the pages cached at that step (what dense decode reads)
    vals: torch.Tensor
    topv: torch.Tensor = None  # (N + 1, T, k) top-k log-probs (topk_logprobs = k), or None
    topi: torch.Tensor = None  # (N + 1, T, k) their ids
    force: torch.Tensor = None  # (N + 1, T) int64 teacher-forced tokens, or None
    steps: int = 0  # decode steps run (the rescoring clock)
    prefill_calls: int = 0  # prefill forwards
    times: list = None  # perf_counter at the start, after the prefill


def forward(model, cache, s, mode="eager"):
    """The part of a step that is compiled or captured: the slots' index tensors, then the model
    over each slot's last token at its position (mode "fused": each layer's work outside
    attention in two C++ calls, layer_cpu.model_forward). -> logits (B, V) fp32, and the pages
    each slot's sparse layers read (B,) (None: dense)."""
    cache.lay_step(s)
    logits = model_forward(mode, model, s.tok[:, None], cache)[:, -1]  # (B, V): a token a slot
    return logits, (cache._counts[2] if cache.budget is not None else None)



def decode_step(run, model, cache, s, call, eng, draft=False):
    """THE decode step, for every slot of the round: the forward (run: eager, compiled or a
    graph's replay), the next token, and the slots moved on in place. Static shapes, no host
    sync. draft=False (dense and sparse decoding): the token is sampled (or forced), written
    with its log-prob, top-k and pages read into the call's buffers at (row, position), and a
    row finishes on the device at EOS or its limit. draft=True (speculative.py): the token is
    drawn as `sample` draws and returned with the distribution it came from, q (B, V) (None at
    temperature 0); a draft never finishes a row (the verify does). -> (token (B,), q)."""
    logits, n_read = run(model, cache, s)
    gen = call.noise.at(s.rows, s.pos)  # keyed draws: the row's own, at its position
    if draft:
        tok, q = draft_sample(logits, eng.temperature, eng.top_p, gen)
        s.tok.copy_(tok)
        s.lens += s.live
        s.pos += s.live
        return tok, q
    if call.force is not None:  # teacher-forced: the given tokens, their log-probs here
        tok = call.force[s.rows, s.pos]
        t = eng.temperature if eng.temperature > 0 else 1.0
        lp = F.log_softmax(logits / t, -1).gather(-1, tok[:, None])[:, 0]
    else:
        tok, lp = sample(logits, eng.temperature, eng.top_p, gen)
    N, T = call.tokens.shape[0] - 1, call.tokens.shape[1]
    at = (torch.where(s.live, s.rows, N), s.pos.clamp(max=T - 1))  # finished, padding: row N
    pages = s.lens // cache.page_size + 1  # cached, the new token in: what dense decode reads
    call.tokens[at] = tok
    call.vals[at] = torch.stack([lp, (pages if n_read is None else n_read).float(),
                                 pages.float()], -1)
    if call.topv is not None:
        call.topv[at], call.topi[at] = topk_logprobs(logits, eng.temperature, call.topv.shape[-1])
    eos = (tok[:, None] == eng.eos_dev).any(-1)
    s.live &= ~eos & (s.pos + 1 < s.limit)  # the finish checks, on the device
    s.tok.copy_(tok)
    s.lens += s.live
    s.pos += s.live
    return tok, None


def run_round(eng, call, steps, draft=False):
    """A round of `steps` decode steps of the call's live rows (Engine.decode). The host lays it
    out once (PagedKVCache.order and begin_round: a bucket of slots, pages for the round's
    tokens); each step is decode_step (static shapes, no CPU-GPU sync). draft=False (dense and
    sparse decoding): then the host looks once (the round's sync), takes the round's tokens and
    releases the rows that finished; -> None. draft=True (speculative.py, on the draft model):
    -> ids (n, steps + 1), each row's last token then its drafts, their q (n, steps, V) (None
    at temperature 0) and the Draws at the first drafts' positions; n = len(call.live), in the
    slots' order, which call.live takes."""
    cache, model = call.cache, (eng.draft if draft else eng.model)
    n, N = len(call.live), len(call.out)
    key = (n if eng.one_step else bucket(n, N), cache.table.shape[1])
    s = eng.slots.get(key)
    if s is None:  # kept: a captured graph replays on this memory
        s = eng.slots[key] = Slots.empty(*key, eng.model.config.num_hidden_layers,
                                         cache.table.device)
    state = lambda r: (steps if draft else min(steps, call.limit[r] - len(call.out[r])),
                       call.out[r][-1], len(call.out[r]), 2**62 if draft else call.limit[r])
    live = call.live = cache.begin_round(call.live, s, state, eng.run.static)
    toks, qs = [s.tok[:n].clone()], []  # the rows' last tokens, then each step's
    ps, lens0 = cache.page_size, [cache.lens[r] for r in live]
    for i in range(steps):
        call.steps = cache.step = call.steps + 1  # the rescoring clock
        # eager: page metadata is written only at steps where a row's page can fill (a
        # compiled or captured step writes it every step, to the scratch page where none does)
        cache.fills = eng.run.static or any((m + i + 1) % ps == 0 for m in lens0)
        tok, q = decode_step(eng.run, model, cache, s, call, eng, draft)
        toks.append(tok[:n])
        qs.append(q)
    cache.read_layer += s.read  # the round's sparse reads
    s.read.zero_()
    if draft:
        for r in live:  # the host's cached lengths
            cache.lens[r] += steps
        draws = call.noise.at(s.rows[:n], s.pos[:n] - steps)  # at the first drafts
        return torch.stack(toks, 1), None if qs[0] is None else torch.stack(qs, 1)[:n], draws
    p0 = len(call.out[live[0]])  # every live row holds as many tokens: one a step
    at = (s.rows[:n, None], p0 + torch.arange(steps, device=s.rows.device))
    both = torch.stack([call.tokens[at].double(), call.vals[at][..., 0].double()])  # exact
    tok_l, lp_l = both.tolist()  # the round's one CPU-GPU sync
    tok_l = [[int(t) for t in r] for r in tok_l]
    look(eng, call, tok_l, lp_l)
    for r in call.live:  # the host's cached lengths: all but the last token taken
        cache.lens[r] = len(call.prompt_ids[r // call.G]) + len(call.out[r]) - 1


def look(eng, call, toks, lps):
    """The host's look at the live rows (once a round): each takes its tokens (`take`), and the
    rows that finished leave and give their pages back."""
    _, done = take(eng, call, call.live, toks, lps)
    for j in sorted(done):
        call.cache.release(call.live[j])
    call.live = [r for j, r in enumerate(call.live) if j not in done]


def take(eng, call, rows, toks, lps):
    """Row rows[j] takes toks[j] (log-probs lps[j]) in order, as one token a step would: it ends
    at EOS, at a stop string or at its limit, and drops what follows. -> (tokens taken per row,
    the j of the rows that ended)."""
    out, eos, taken, done, check = call.out, set(eng.eos.tolist()), [], set(), []
    for j, r in enumerate(rows):
        n0 = len(out[r])
        for t, x in zip(toks[j], lps[j]):
            out[r].append(t)  # EOS is sampled and trained on; it is not part of the text
            call.lps[r].append(x)
            if t in eos or len(out[r]) == call.limit[r]:
                call.finish[r] = "eos" if t in eos else call.finish[r]
                done.add(j)
                break
        taken.append(len(out[r]) - n0)
        check.append(taken[-1] - (call.finish[r] == "eos"))  # where a stop string may end
    for c in range(1, max(check, default=0) + 1 if eng.stop else 1):  # a token at a time
        at = {j: out[r][:len(out[r]) - taken[j] + c] for j, r in enumerate(rows)
              if check[j] >= c and call.finish[r] != "stop"}
        for j in eng._stopped(at, list(at)) if at else []:
            r, cut = rows[j], len(out[rows[j]]) - taken[j] + c
            del out[r][cut:], call.lps[r][cut:]
            call.finish[r], taken[j] = "stop", c
            done.add(j)
    return taken, done


class Runner:
    """How decode_step's forward runs: "eager" (the reference), "compile" (torch.compile, per
    bucket) or "graph" (a CUDA graph per bucket). seconds: compile or capture time so far, and
    the first (warm-up) steps that paid it, apart from the steps' own time."""

    def __init__(self, mode):
        self.mode, self.seconds, self.graphs, self.fn, self.mempool = mode, 0.0, {}, None, None

    @property
    def static(self):
        """Whether the step's shapes stay fixed for a bucket (compiled or captured)."""
        return self.mode in ("compile", "graph")

    def __call__(self, model, cache, s):
        if self.mode == "fused":
            return forward(model, cache, s, "fused")
        if self.mode == "compile":
            if self.fn is None:
                # each C++ call (attention, the packed matmuls) is a graph break, and the frames
                # between are specialised per layer and bucket: more than dynamo's default 8
                dynamo = torch._dynamo.config
                dynamo.recompile_limit = max(dynamo.recompile_limit, 128)
                self.fn = torch.compile(forward, dynamic=False)
            key = ("compiled", s.tok.shape[0], s.table.shape[1], id(model))
            if key not in self.graphs:  # the first call of a bucket compiles: timed apart
                t0 = time.perf_counter()
                out = self.fn(model, cache, s)
                self.graphs[key], self.seconds = True, self.seconds + time.perf_counter() - t0
                return out
            return self.fn(model, cache, s)
        if self.mode == "graph":
            key = graph_key(model, cache, s, self)
            g = self.graphs.get(key)
            if g is None:  # warm-up (a real step), then capture: both timed apart
                t0 = time.perf_counter()
                out = forward(model, cache, s)
                self.graphs[key] = capture(model, cache, s, self)
                self.seconds += time.perf_counter() - t0
                return out
            g[0].replay()
            return g[1]
        return forward(model, cache, s)


def graph_key(model, cache, s, runner):
    """What a captured step bakes in: the slots, the model, the memory of the KV pool's buffers
    and of the weights (read once a call). Any change: capture again."""
    if getattr(cache, "graph_sig", None) is None:
        bufs = tuple(t.data_ptr() for t in (cache.k, cache.v, cache.kmean) if t is not None)
        cache.graph_sig = (id(model), bufs, tuple(p.data_ptr() for p in model.parameters()))
    return id(s), cache.graph_sig


def capture(model, cache, s, runner):
    """decode_step's forward captured as a CUDA graph over the slots `s` (nano-vllm and SGLang
    capture decode the same way), after an eager step of the same bucket (the warm-up: lazy
    initialisation, Triton's compile), on a memory pool that every bucket's graph shares (a
    graph's intermediates are dead once it returns, and each output is read before the next
    replay). Capturing runs nothing: the slots and the pool are untouched. -> (graph, outputs)."""
    if runner.mempool is None:
        runner.mempool = torch.cuda.graph_pool_handle()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=runner.mempool):
        out = forward(model, cache, s)
    return g, out


def run_mode(eng):
    """How the engine's steps run this call, from its step mode: auto is a graph where capture
    is safe for both of its models, else fused where both allow it (CPU), else eager; graph and
    fused fall back to eager where refused."""
    safe = not graph_refusals(eng, eng.model) + graph_refusals(eng, eng.draft)
    fused = not fused_refusals(eng.model) + fused_refusals(eng.draft)
    return {"auto": "graph" if safe else "fused" if fused else "eager",
            "graph": "graph" if safe else "eager",
            "fused": "fused" if fused else "eager"}.get(eng.step_mode, eng.step_mode)


def graph_refusals(eng, model):
    """Why a captured step of `model` would not replay what the eager one runs (the docstring's
    list; empty: capture is safe)."""
    why = {"not on CUDA": model.lm_head.weight.device.type != "cuda",
           "record_pages": eng.record_pages, "MoE": getattr(model.config, "num_experts", 0),
           "rescore_every > 1": eng.budget is not None and eng.rescore_every > 1,
           "autocast": torch.is_autocast_enabled("cuda")}
    return [k for k, v in why.items() if v]
