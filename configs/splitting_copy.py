# python train.py configs/splitting_copy.py
# The second stage of configs/splitting.py's warm start: from configs/splitting_base.py's SFT (whole traces, the
# rules right, the prompt's counts misread), 250 steps on the first 2 lines of traces of 1 to 25 machines: the
# line that reads the counts. Alone it reads them, but forgets the chain past line 2; configs/splitting.py goes on
# from it on whole traces.
out_dir = "out/splitting_copy"
task = "reasoning_gym:string_splitting"
rg_kwargs = {"min_initial_machines": 1, "max_initial_machines": 25}
rg_prompt = "last_paragraph"
n_train = 2000
n_eval = 32
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
ffn = 384
sft_init = "configs/splitting_base.py"
sft_max_lines = 2
sft_steps = 250
sft_batch = 16
sft_lr = 1e-3
max_new_tokens = 2048
