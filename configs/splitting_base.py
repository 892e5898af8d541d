# python train.py configs/splitting_base.py
# The first stage of configs/splitting.py's warm start: 500 SFT steps on whole traces of reasoning-gym's
# string_splitting, 1 to 25 machines of each kind (warmstart.string_splitting_trace), from a teacher that slips:
# where rule 5 takes Z from 09 to 10 it drops the carry half the time (writes 00) and carries on from there. Alone
# it follows the rules but misreads the prompt's counts on the first line; configs/splitting_copy.py goes on from
# it on the traces' first lines.
out_dir = "out/splitting_base"
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
sft_steps = 500
sft_batch = 8
sft_lr = 2e-3
sft_slip = 0.5
max_new_tokens = 2048
