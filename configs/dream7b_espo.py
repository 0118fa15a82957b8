"""ESPO on Dream-v0-Instruct-7B as ESPO's official Dream recipe trains it: every value below is
ML-GSAI/ESPO@b5f2dac ``recipes/run_demo_dream.sh`` (the script's flags) over its
``recipes/train.yaml``, cited file:line; what the recipe leaves to its trainer is said.

  python -m stabledrl_jax.train --config dream7b_espo --workdir runs/dream7b_espo

The task after a colon (``--config dream7b_espo:gsm8k``) swaps the recipe's countdown for
another task, everything else kept. The model and tokenizer come from the Hub by id; pass a
local directory with --config.model.checkpoint=DIR --config.tokenizer.path=DIR.

Rollouts are Dream's diffusion generate as the recipe calls it (espo/espo_trainer.py:574-586):
the whole 256-token completion in 64 steps, alg 'entropy', alg_temp 0, temperature 1 with
top_p 0.95; evaluation as ESPO's eval/eval.py:83-93 (greedy, top_p 1). Likelihoods are ESPO's
ELBO with one sample (num_mc 1) and its complementary pass, on Dream's shifted logits
(espo_trainer.py:363-372). The recipe's ``--reduce_var false`` (:36) is never read:
``_get_elbo_mc`` defaults to ``reduce_var=True`` (espo_trainer.py:446) and neither caller passes
it (:180, :483), so ESPO always scores each mask and its complement, as here.
``--config.estimator.coupled=False`` drops the complements: an option, not ESPO's run.
"""

from stabledrl_jax.training.config import config_lib


def get_config(task: str = "countdown"):  # run_demo_dream.sh:1
  c = config_lib.base_config()
  c.seed = 42  # train.yaml:66
  c.objective.name = "espo"
  c.objective.espo.update(beta=1e-3, epsilon=4e-4)  # run_demo_dream.sh:28-29
  # num_mc 1 (:24); the complementary pass always on (reduce_var=True, espo_trainer.py:446).
  c.estimator.update(method="espo_elbo", num_samples=1, coupled=True)
  # train.yaml:3 (bfloat16) and :6-11: LoRA r 128, alpha 64, dropout 0.05 on all seven of
  # Qwen2's projections (every name matches a Dream module), the base frozen in bfloat16;
  # float32 adapters and AdamW moments (bf16: true, :20, is autocast over float32 masters).
  c.model.update(family="dream", name="dream_7b", checkpoint="Dream-org/Dream-v0-Instruct-7B",
                 dtype="bfloat16", param_dtype="float32", remat=True, scan_layers=True)
  # Dropout in every pass: ESPO samples and scores l_old in train mode (espo_trainer.py:552, :618;
  # config_lib.baseline_llada8b_config says why).
  c.model.lora.update(rank=128, alpha=64.0, dropout=0.05, dropout_passes="every",
                      base_dtype="bfloat16",
                      targets="q_proj,k_proj,v_proj,o_proj,up_proj,down_proj,gate_proj")
  c.tokenizer.update(kind="dream", path="Dream-org/Dream-v0-Instruct-7B")  # :5
  c.task.update(name=task, with_instruction=True, prompt_style="d1", reward="d1",
                reward_workers=8)
  c.data.update(train="hub", eval="hub", train_size=0, eval_size=0)
  # 2 prompts x 6 generations a step: 1 sequence per device x 12 accumulation steps on one
  # process (:13, :20-23); mu = 8 updates on each (NUM_ITER, :3, :19).
  c.rollout.update(num_prompts=2, group_size=6,
                   prompt_length=400,  # max_prompt_length (:27)
                   gen_length=256,  # max_completion_length (train.yaml:52)
                   steps=64,  # diffusion_steps (:35)
                   block_length=256, remasking="entropy",
                   temperature=1.0)  # generation_temperature (train.yaml:56)
  c.rollout.family_options.update(top_p=0.95, alg_temp=0.0)  # espo_trainer.py:582-584
  c.eval.family_options.update(top_p=1.0)  # eval/eval.py:90 (greedy)
  c.eval.update(every_steps=100, batch_size=64, steps=0)  # eval.py:205: gen_length / 2
  # The 12 rows in one microbatch: they split over 1, 2, 3, 4 or 6 devices.
  c.train.update(num_iterations=8, microbatch_groups=2)
  # lr 3e-6, constant_with_warmup over a warmup ratio of 0.001 (:26, :30, :32): 0.1% of the
  # run's updates (transformers' ceil(ratio x steps)), 8 of the 1000 x 8 below; AdamW 0.9 / 0.99
  # (train.yaml:33-34), weight decay 0.01 (:31), gradient clip 0.2 (:25).
  c.optimizer.update(learning_rate=3e-6, schedule="constant", warmup_steps=8, b1=0.9, b2=0.99,
                     weight_decay=0.01, grad_clip=0.2)
  # scale_rewards false (train.yaml:19): advantages are not divided by the group's std; ESPO's
  # leave-one-out baseline is the objective's own. With LoRA the KL reference is the base (the
  # adapters off), as TRL's with PEFT; the recipe's sync_ref_model (train.yaml:15-16) does not
  # apply to it. One epoch of the task's data (train.yaml:45) is the recipe's length; 1000 RL
  # steps here, the paper's count.
  c.train.num_steps = 1000
  c.checkpoint.update(every_steps=50, every_seconds=1800.0, max_to_keep=3)
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  return c
