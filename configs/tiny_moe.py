# python train.py configs/tiny_moe.py --threads=1
# The embedded default's task on a small Qwen3-MoE (8 experts, top-2, in every layer), trained with router replay
# (R3): a bf16 rollout copy generates and records the experts of every token; the trainer's forwards route through
# those experts instead of its own top-k. Everything not set here is the Config default.
out_dir = "out/tiny_moe"
# data: as configs/tiny.py
task = "synthetic"
difficulty = (2, 8)
order = "defined"
n_train = 20000
n_eval = 200
# the model: configs/tiny.py's shape with each layer's MLP swapped for 8 experts of width 96, 2 per token
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
ffn = 384               # unused: every layer is an MoE layer
n_expert = 8
n_expert_active = 2
moe_ffn = 96
# warm start: SFT as configs/tiny.py's (the same imperfect teacher), built once and cached for this shape
sft_steps = 600
sft_batch = 16
sft_lr = 1e-3
sft_noise = 0.6
# rollouts come from a bf16 copy: its routing and its log-probs differ from the fp32 trainer's
rollout_copy = "bf16"
is_correction = "tis"
# router replay: the recorded experts in logp_old's pass and in the update (off | logprob | update)
router_replay = "update"
moe_aux_coef = 0.001    # the load-balancing loss, on the replayed experts
# RL: a shorter run than configs/tiny.py's
prompts_per_step = 16
group_size = 8
max_new_tokens = 64
lr = 1e-4
steps = 30
warmup_steps = 5
micro_batch = 64
eval_every = 10
save_every = 10
