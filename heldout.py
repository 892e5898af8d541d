"""
heldout.py: held-out evaluation, the accuracy train.py reports. Greedy accuracy per difficulty on
the policy itself, sampled pass@1 to pass@k (eval_sampled), and the example completions shown
before and after RL, all scored by the run's own cascade. Each trainer evaluates a slice of the
held-out set and the figures are gathered, so every rank returns the same numbers.

    acc, by_difficulty, shown = evaluate(cfg, run)   # greedy; shown: {index: (completion, reward)}
    passes = evaluate(cfg, run, k=64)                # {"pass@1": {difficulty: ...}, ..., "pass@64"}
    before_rl(cfg, run, history, log)                # the warm start's figures and examples
    during_rl(cfg, run, history, rec, last)          # each eval step; the last one's pass@k too

Accuracy means a right answer: a problem counts when the cascade scores it 1. reasoning-gym's
score_answer gives partial credit (chain_sum: "1-4" or "-40" for -4 scores 0.67); held-out
accuracy and pass@k count none of it. With eval_k_per_bin, pass@k runs on the first that many
problems of each difficulty (sampled_subset); `counts` gives the problems behind each figure.

Simplifications:
    1. Greedy evaluation runs on the policy itself (run.greedy), not the rollout copy.
    2. Sampled evaluation draws with seed 0 at the rollout temperature.
    3. A generate call holds as many prompts as the run's KV pool fits (config key kv_pool_tokens;
       rollout.Engine.calls): greedy figures do not depend on the cut, sampled ones draw a
       different stream for each call's rows.
"""

import torch

import parallel
from report import by_difficulty, examples, pass_at, pass_ks
from rollout import Engine


def before_rl(cfg, run, history, log):
    """The warm start's held-out figures (greedy, and pass@k with eval_sampled) and the examples
    the run will show again at its end, into `history`."""
    history["counts"] = counts(cfg, run.eval_p)
    history["acc0"], greedy, shown = evaluate(cfg, run, texts=range(len(run.eval_p)))
    sampled = evaluate(cfg, run, k=cfg.eval_k or cfg.group_size) if cfg.eval_sampled else {}
    history["start"] = {"greedy": greedy, **sampled}  # sampled: {"pass@1": {d: ...}, ...}
    history["examples"] = [{"index": i, "prompt": run.eval_p[i].prompt,
                            "answer": run.eval_p[i].answer, "before": shown[i][0]}
                           for i in examples(run.eval_p, shown)]
    log(f"held-out accuracy before RL: {history['acc0']:.3f} on {len(run.eval_p)} problems")


def sampled_subset(cfg, problems):
    """The held-out problems pass@k samples: the first eval_k_per_bin of each difficulty (every
    problem where it is 0) -> their indices."""
    seen, out = {}, []
    for i, p in enumerate(problems):
        d = p.meta.get("difficulty")
        seen[d] = seen.get(d, 0) + 1
        if not cfg.eval_k_per_bin or seen[d] <= cfg.eval_k_per_bin:
            out.append(i)
    return out


def counts(cfg, problems):
    """The problems behind each figure: {"greedy": {difficulty: n}, "sampled": {difficulty: n}}."""
    out = {"greedy": {}, "sampled": {}}
    for side, idx in (("greedy", range(len(problems))), ("sampled", sampled_subset(cfg, problems))):
        for i in idx:
            d = problems[i].meta.get("difficulty")
            if d is not None:
                out[side][d] = out[side].get(d, 0) + 1
    return out


def during_rl(cfg, run, history, rec, last):
    """An evaluation step: greedy accuracy into the step's record; at the last step, the shown
    examples' completions after RL and (eval_sampled) the end's pass@k beside the start's."""
    picks = [ex.get("index") for ex in history["examples"]] if last else ()
    rec["acc"], rec["acc_by_difficulty"], shown = evaluate(cfg, run, texts=picks)
    for ex in history["examples"]:
        ex["after"] = shown.get(ex.get("index"), (ex.get("after"),))[0]
    if last and cfg.eval_sampled:
        history["end"] = {"greedy": rec["acc_by_difficulty"],
                          **evaluate(cfg, run, k=cfg.eval_k or cfg.group_size)}


@torch.no_grad()
def evaluate(cfg, run, k=1, texts=()):
    """Held-out accuracy, scored by the same cascade, each trainer on a slice: greedy by default
    -> (accuracy, {difficulty: accuracy}), a problem right when it scores 1; with k > 1, k samples
    per problem of sampled_subset at the rollout temperature -> {"pass@j": {difficulty: pass@j}}
    for j = 1, 8, 64, ..., k (report.pass_at).
    `texts`: indices of problems whose greedy completions to return too, as
    {index: (completion, reward)} (the before/after examples)."""
    me, n, ks = run.role.me, run.role.n, pass_ks(k)
    every = range(len(run.eval_p)) if k == 1 else sampled_subset(cfg, run.eval_p)
    mine, scores, shown = list(every[me::n]), [], {}
    # sampled: on the policy, over the run's KV pool (the rollout engine's), in its dtype
    engine = run.greedy if k == 1 else Engine(run.greedy.model, temperature=cfg.temperature,
                                              tokenizer=run.tok, max_new_tokens=cfg.max_new_tokens,
                                              stop=run.greedy.stop, kv_dtype=cfg.kv_dtype,
                                              page_size=run.greedy.page_size,
                                              pool=run.sparse.pool)
    prompts = [run.eval_ids[i] for i in mine]
    for a, b in engine.calls(prompts, k):  # as many prompts a call as the KV pool holds
        chunk = mine[a:b]
        ro = engine.generate(prompts[a:b], k, seed=0)
        res = run.cascade.score_batch([run.eval_p[i] for i in chunk for _ in range(k)], ro.texts,
                                      group_size=k, finish=ro.finish)
        r = torch.tensor(res.rewards, device="cpu").view(-1, k)  # host: scored and kept there
        scores += [(run.eval_p[i].meta.get("difficulty"), (x >= 1.0).float().mean().item(),
                    *pass_at(x, ks)) for i, x in zip(chunk, r)]  # right answers only
        shown.update({i: (ro.texts[j * k], res.rewards[j * k]) for j, i in enumerate(chunk)
                      if i in texts})
    scores = [x for part in parallel.gather(scores, n, run.role.group) for x in part]
    shown = {i: t for part in parallel.gather(shown, n, run.role.group) for i, t in part.items()}
    if k > 1:
        return {f"pass@{j}": by_difficulty(scores, 2 + m) for m, j in enumerate(ks)}
    return sum(x[1] for x in scores) / len(scores), by_difficulty(scores, 1), shown
