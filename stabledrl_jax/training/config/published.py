"""What each baseline's published LLaDA-8B-Instruct RL run uses, per task, cited file:line at the
commits docs/algorithms.md names (d1 837888f, SPG a1c7120, wd1 0898985, ESPO b5f2dac).

The baseline configs (``config_lib.baseline_llada8b_config``) take each one's algorithm, LoRA,
optimizer and per-task hyperparameters and run them on the paper's shared rollouts, batch,
prompts, rewards and evaluation: a matched-budget comparison. This record is the other side,
what the published runs set where that comparison differs; ``experiments/baseline_table.py``
sets the two side by side (the README's table). Values are facts read from the official code;
each is a (value, citation) pair, the value as the code gives it.

Where a published value is not set in the code it is the trainer's default, cited there. Batch
sizes are prompts x completions per optimizer step: per_device_train_batch_size x processes x
gradient_accumulation_steps / num_generations prompts (TRL's GRPO sampler), each sampled once
and reused for mu updates.
"""

from __future__ import annotations

from typing import Any

BASELINES = ("d1", "spg", "wd1", "espo")
TASKS = ("gsm8k", "math500", "countdown", "sudoku")
# The settings recorded, in the table's order.
FIELDS = ("batch", "mu", "length", "prompt_cap", "steps", "temperature", "warmup", "beta",
          "epsilon", "rewards", "data")

_D1 = "diffu-grpo/slurm_scripts/"
_D1_COMMON = {
    "batch": ("16 x 6", f"{_D1}train.yaml:37,41-42 on 8 GPUs ({_D1}gsm_base.sbatch:9)"),
    "length": ("10 epochs", f"{_D1}train.yaml:38"),
    "prompt_cap": ("last 200 tokens kept", f"{_D1}train.yaml:61, "
                   "diffu-grpo/diffu_grpo_trainer.py:399-400"),
    "steps": ("128 over 256 tokens, blocks of 32", f"{_D1}train.yaml:60,62-63"),
    "temperature": ("0.9", "diffu-grpo/diffu_grpo_config.py:193-194 (the default)"),
    "warmup": ("ratio 1e-4", f"{_D1}train.yaml:32"),
    "beta": ("0.04", f"{_D1}train.yaml:68"),
    "epsilon": ("0.5", f"{_D1}train.yaml:69"),
}
_SPG = "spg/slurm_scripts/"
_SPG_COMMON = {
    "batch": ("16 x 6", f"{_SPG}spg_mix/gsm_base_spg_mix_beta1.5_weight0.5.sbatch:9,44-46"),
    "length": ("10 epochs", f"{_SPG}train.yaml:38"),
    "prompt_cap": ("last 200 tokens kept", f"{_SPG}train.yaml:61, spg/spg_trainer.py:597"),
    "steps": ("128 over 256 tokens, blocks of 32", f"{_SPG}train.yaml:60,62-63"),
    "temperature": ("0.9", "spg/diffu_grpo_config.py (the default)"),
    "warmup": ("ratio 1e-4", f"{_SPG}train.yaml:32"),
    "epsilon": ("none (no ratio)", "spg/spg_trainer.py:114-118"),
}
_WD1_COMMON = {
    "batch": ("8 x 6", "wd1/train.yaml:37,43-44 on 4 GPUs (run/wll_NP_gsm8k.sh:24,26)"),
    "length": ("10 epochs", "wd1/train.yaml:38"),
    "prompt_cap": ("last 200 tokens kept", "wd1/train.yaml:63, "
                   "wd1/trainers/diffu_grpo_trainer.py:487-488"),
    "steps": ("128 over 256 tokens, blocks of 32", "wd1/train.yaml:62,64-65"),
    "temperature": ("0.9", "wd1/trainers/diffu_grpo_config.py (the default)"),
    "warmup": ("ratio 1e-4", "wd1/train.yaml:32"),
    "beta": ("none (a weighted likelihood)", "wd1/trainers/rev_grpo_trainer.py:144-160"),
    "epsilon": ("none (no ratio)", "wd1/trainers/rev_grpo_trainer.py:144-160"),
}
_ESPO_COMMON = {
    "batch": ("16 x 6", "recipes/run_gsm8k_llada.sh:13,20-23"),
    "mu": ("8", "recipes/run_gsm8k_llada.sh:3"),
    "length": ("1 epoch", "recipes/train.yaml:45"),
    "prompt_cap": ("last 400 tokens kept", "recipes/run_gsm8k_llada.sh:27, "
                   "espo/espo_trainer.py:544-545"),
    "steps": ("256 over 256 tokens, blocks of 32", "recipes/run_gsm8k_llada.sh:34, "
              "espo/espo_trainer.py:568"),
    "temperature": ("1", "recipes/train.yaml:56"),
    "warmup": ("ratio 1e-3", "recipes/run_gsm8k_llada.sh:26"),
    "beta": ("0.001", "recipes/run_gsm8k_llada.sh:28"),
    "epsilon": ("0.2", "recipes/train.yaml:18"),
}
_D1_REWARDS = {
    "gsm8k": ("correctness 2.0 + int + three format terms", "diffu-grpo/diffu_grpo_train.py:37-45"),
    "math500": ("correctness + boxed format", "diffu-grpo/diffu_grpo_train.py:52-57"),
    "countdown": ("countdown_reward_func", "diffu-grpo/diffu_grpo_train.py:46-48"),
    "sudoku": ("fraction of blanks right", "diffu-grpo/diffu_grpo_train.py:49-51"),
}
_D1_DATA = {
    "gsm8k": ("openai/gsm8k train, whole", "diffu-grpo/data_utils.py:68"),
    "math500": ("ankner/math-500 train, whole", "diffu-grpo/data_utils.py:120"),
    "countdown": ("3-number puzzles only; last 500 held out",
                  "diffu-grpo/data_utils.py:81, diffu-grpo/diffu_grpo_train.py:63-64"),
    "sudoku": ("last 500 held out", "diffu-grpo/diffu_grpo_train.py:63-64"),
}

PUBLISHED: dict[str, dict[str, dict[str, tuple[str, str]]]] = {
    "d1": {task: {**_D1_COMMON, "mu": (mu, f"{_D1}{script}_base.sbatch:24"),
                  "rewards": _D1_REWARDS[task], "data": _D1_DATA[task]}
           for task, mu, script in (("gsm8k", "12", "gsm"), ("math500", "12", "math"),
                                    ("countdown", "8", "countdown"), ("sudoku", "8", "sudoku"))},
    "spg": {
        task: {**_SPG_COMMON, "mu": ("4", f"{_SPG}spg_mix/{script}.sbatch:{28 + late}"),
               "beta": ("none (beta 0)", f"{_SPG}spg_mix/{script}.sbatch:{47 + late}"),
               "rewards": (_D1_REWARDS[task][0],
                           "spg/diffu_grpo_train.py:43-66, spg/reward_func.py"),
               "data": data}
        for (task, data), (script, late) in zip((
            ("gsm8k", ("openai/gsm8k train, whole", "spg/diffu_grpo_train.py:69,74-75")),
            ("math500", ("ankner/math-500 train, whole", "spg/diffu_grpo_train.py:69,74-75")),
            ("countdown", ("3-number puzzles only; last 500 held out", "spg/data_utils.py:88")),
            ("sudoku", ("its own split: 200 solution grids (3-shot prompts of up to 1500 "
                        "tokens, temperature 0.3)",
                        "dataset/generate_new_sudoku_splitting.py:11-13, "
                        f"{_SPG}spg_mix/sudoku_new_base_spg_mix_beta1.0_weight0.5.sbatch:52,54"))),
            # Each task's script and the shift of its lines (sudoku's has one line more).
            (("gsm_base_spg_mix_beta1.5_weight0.5", 0), ("math_base_spg_mix_beta1.5_weight0.5", 0),
             ("countdown_base_spg_mix_beta1.5_weight0.5", 0),
             ("sudoku_new_base_spg_mix_beta1.0_weight0.5", 1)), strict=True)},
    "wd1": {task: {**_WD1_COMMON, "mu": (mu, f"run/wll_NP_{script}.sh:22"),
                   "rewards": (_D1_REWARDS[task][0], "wd1/run_train.py:66-88"),
                   "data": (_D1_DATA[task][0], "wd1/run_train.py:91-99, wd1/data_utils.py:81")}
            for task, mu, script in (("gsm8k", "12", "gsm8k"), ("math500", "12", "math"),
                                     ("countdown", "12", "countdown"),
                                     ("sudoku", "8", "sudoku"))},
    "espo": {
        "gsm8k": {**_ESPO_COMMON,
                  "rewards": ("correctness 1.0 only", "espo/rewards.py:211-238,416-418"),
                  "data": ("openai/gsm8k train, whole", "espo/data_utils.py:79")},
        "math500": {**_ESPO_COMMON,
                    "batch": ("16 x 16", "recipes/run_math_llada.sh:13,20-23"),
                    "rewards": ("correctness only", "espo/rewards.py:386-413,419"),
                    "data": ("its math train set, whole", "espo/data_utils.py:93")},
        "countdown": {**_ESPO_COMMON,
                      "steps": ("128 over 256 tokens, blocks of 32",
                                "recipes/run_countdown_llada.sh:35"),
                      "beta": ("0.003", "recipes/run_countdown_llada.sh:28"),
                      "epsilon": ("0", "recipes/run_countdown_llada.sh:29"),
                      "rewards": ("reward_func_countdown", "espo/rewards.py:310,420"),
                      "data": ("3-number puzzles only", "espo/data_utils.py:106")},
        "sudoku": {**_ESPO_COMMON,
                   "steps": ("128 over 256 tokens, blocks of 32",
                             "recipes/run_sudoku_llada.sh:34"),
                   "beta": ("0.01", "recipes/run_sudoku_llada.sh:28"),
                   "rewards": ("reward_func_sudoku", "espo/rewards.py:355,421"),
                   "data": ("4x4_sudoku_unique_puzzles.csv, whole", "espo/data_utils.py:125-130")},
    },
}


def of(baseline: str, task: str) -> dict[str, tuple[str, str]]:
  """{field: (value, citation)} of ``baseline``'s published run on ``task``; ValueError naming
  what has no record."""
  if baseline not in PUBLISHED:
    raise ValueError(f"no published record of {baseline!r}; the baselines are {BASELINES}")
  if task not in PUBLISHED[baseline]:
    raise ValueError(f"{baseline}'s published runs have no {task!r} task; its tasks are "
                     f"{sorted(PUBLISHED[baseline])}")
  return PUBLISHED[baseline][task]


def fields(record: dict[str, Any]) -> list[str]:
  """The record's fields in ``FIELDS`` order (every one of them: a record is whole)."""
  return [field for field in FIELDS if field in record]
