# python train.py configs/gsm8k_qwen3_moe.py
# One GPU (an H200's 141 GB; an 80 GB card is too small for the bf16 weights plus activations): GRPO on GSM8K
# from Qwen3-30B-A3B (48 layers of 128 experts, 8 per token) with router replay. Needs a network for the model
# and the data. Status: NOT RUN. Written from the model's config and this repository's memory arithmetic only; no
# step of it has been run on a GPU.
model = "Qwen/Qwen3-30B-A3B"
task = "gsm8k"          # openai/gsm8k, config "main": train for RL, test for held-out accuracy
n_train = 0
n_eval = 500
out_dir = "out/gsm8k_qwen3_30b_a3b"
dtype = "bfloat16"      # 30.5B parameters: 61 GB of bf16 weights, no fp32 master copy
autocast = "bfloat16"
# full fine-tuning would need about 4x the weights' memory for AdamW: train a LoRA adapter instead. LoRA leaves
# the router frozen, so replay here fixes the routing of the log-probs; the router's gradient flows but nothing
# updates it (moe_aux_coef has no parameter to move: keep it 0)
lora_r = 32
lora_alpha = 64
lr = 1e-5               # about 10x full fine-tuning's, as usual for LoRA
# the policy generates itself (rollout_copy = "same"): the engine's batched, cached bf16 decode still routes some
# tokens differently from the trainer's full-sequence forward; replay removes that difference
rollout_copy = "same"
router_replay = "update"
moe_aux_coef = 0.0
prompts_per_step = 16
group_size = 8
max_new_tokens = 512
temperature = 1.0
warmup_steps = 10
steps = 200
micro_batch = 2         # 48 layers of an expert loop (model.py's reference MoE): activations, not weights, decide
eval_every = 50
save_every = 50
