"""
bench: side-by-side measurements. Every figure is a ratio of two things timed in the same run on the
same machine, printed as a markdown table whose rows name the hardware and the command. One file per
section; the full tables, with what they say, are in bench/RESULTS.md.

    python -m bench rollout --threads 1       # stage 2: the rollout engine (8 minutes on one core)
    python -m bench rollout --quick           # smaller sizes: a smoke run of the same code
    python -m bench rollout --write-results   # also rewrite the rollout block of bench/RESULTS.md
    python -m bench signal --threads 1        # stages 1 and 3: 5 seeds x 4 short runs (30 minutes)
    python -m bench sparrow --jobs 2          # stage 2 in the loop: 9 long-CoT arms x 3 seeds (hours)
    python -m bench sparrow --config configs/splitting.py  # the same arms on a second task family
    python -m bench lowalpha --threads 1      # stage 2: low alpha by token type on the long-CoT task
    python -m bench sparsecost --threads 1    # stage 2: where a decode step's time goes (4 minutes)
    python -m bench specdecode --threads 1    # stage 2: speculative decode vs dense (10 minutes)

Files:
    __main__.py    the command line: one section, --quick, --threads, --jobs, --write-results
    common.py      the timer (best_of), the hardware string, table rows, the results writer
    cost.py        the cost model (model_shape, rollout_cost) and its check against the engine
    rollout.py     the engine vs transformers, shared prefill, sparse decode on the CPU and GPU
    signal.py      growth-zone and dynamic sampling vs uniform sampling, same number of rollouts
    regime.py      the long-CoT regime: attention's share of decode, the pages each scorer needs
    lowalpha.py    where low alpha falls on the long-CoT task, by token type, per scorer and budget
    sparrow.py     the miniature Sparrow experiment: nine long-CoT arms, dense to speculative, 3 seeds
    sparrow_runs/  each sparrow run's record (arguments and summary), for resuming and the table
    sparsecost.py  a long-CoT decode step split into attention, page selection and the rest
    sparsepath.py  the CPU sparse path against dense attention at 1k-4k cached tokens
    specdecode.py  lossless sparse rollout: self-speculative decode against dense, measured and
                   predicted (the cost model), and the prediction for Qwen3-1.7B at 32K
    pagereads.py   what reading a fraction of the KV pages costs the memory system
    gpu.py         one GPU: the kernel, FlexAttention, SDPA, engine decode (torch and triton only)
    step.py        a whole RL step against TRL's GRPOTrainer
    syncbytes.py   stage 5: the bytes a bf16 copy's delta ships per step
    demo.py        the default's RL against cheaper uses of the same rollouts
    moe.py         router replay in the loop, on the tiny MoE
    RESULTS.md     the tables: one <!-- bench:SECTION --> ... <!-- /bench:SECTION --> block each

Each section module has `run(quick, cmd) -> lines` (sparrow's also takes `jobs` and `config`): the
table, head included, that the command prints and that --write-results puts between the section's
markers.
Nothing is imported here: `python -m bench rollout` loads only what the rollout section needs.
"""
