r"""Gradient norms of GRPO and StableDRL under noisy likelihood-ratio estimates.

A small, self-contained demonstration of the paper's mechanism on the core
layer (objectives + estimators), no training: a random bag-of-context model
scores P x G completions; pi_theta = pi_old, so every deviation of log rho from
0 is estimator noise. For each condition we draw fresh masks many times and
report the gradient norm of each objective with respect to the model
parameters (median and largest finite value, and the fraction of draws whose
gradient overflowed to inf/nan), and the largest log10 rho of the sum-form
sequence ratio seen.

Conditions:
  independent: numerator and denominator ELBOs with independent random masks
    (the official StableDRL setting: pure Monte Carlo noise).
  stress: docs/stress_test.md, in a fraction 0.7 of the samples the numerator uses
    "easy" tail masks and the denominator "hard" head masks.

Usage:
  python experiments/ratio_noise_demo.py [--draws 16] [--output demo.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from stabledrl_jax import estimators, objectives

VOCAB, DIM, PROMPT_LEN, GEN_LEN = 12, 16, 4, 24
MASK_ID = VOCAB - 1
NUM_PROMPTS, GROUP = 4, 8


def init_params(key):
  k_emb, k_pos, k_out = jax.random.split(key, 3)
  length = PROMPT_LEN + GEN_LEN
  return {
      "embed": jax.random.normal(k_emb, (VOCAB, DIM)),
      "pos": jax.random.normal(k_pos, (length, DIM)) * 0.5,
      "out": jax.random.normal(k_out, (DIM, VOCAB)) * 0.3,
  }


def logits_fn(params, tokens):
  """Bidirectional bag-of-context model: [B, L] -> [B, L, V]."""
  visible = (tokens != MASK_ID)[..., None]
  context = jnp.sum(params["embed"][tokens] * visible, axis=1, keepdims=True)
  hidden = jnp.tanh(context / 4.0 + params["pos"][None])
  return hidden @ params["out"]


def make_batch(key):
  n = NUM_PROMPTS * GROUP
  k_tok, k_rew = jax.random.split(key)
  tokens = jax.random.randint(k_tok, (n, PROMPT_LEN + GEN_LEN), 0, MASK_ID)
  prompt_mask = jnp.zeros(tokens.shape, bool).at[:, :PROMPT_LEN].set(True)
  completion_mask = ~prompt_mask
  rewards = jax.random.bernoulli(k_rew, 0.5, (n,)).astype(jnp.float32)
  return tokens, prompt_mask, completion_mask, objectives.group_advantages(rewards, GROUP)


def make_step(condition: str):
  """Returns jitted (params, key) -> {objective: grad norm, 'max_log10_ratio'}."""

  @jax.jit
  def step(params, key):
    k_batch, k_num, k_den, k_sel = jax.random.split(key, 4)
    tokens, prompt_mask, completion_mask, adv = make_batch(k_batch)
    sample = lambda k: estimators.sample_masks(k, prompt_mask, completion_mask,
                                               method="elbo", num_samples=2)
    num_masks, den_masks = sample(k_num), sample(k_den)
    if condition == "stress":
      selected = estimators.stress_selection(k_sel, tokens.shape[0], 0.7)
      stress = lambda mode, rate: estimators.stress_masks(
          prompt_mask, completion_mask, mode=mode, rate=rate, num_samples=2)
      num_masks = estimators.select_masks(selected, stress("easy", 0.05), num_masks)
      den_masks = estimators.select_masks(selected, stress("hard", 1.0), den_masks)

    def estimates(p, masks):
      return estimators.estimate_logp(lambda t: logits_fn(p, t), tokens, prompt_mask,
                                      completion_mask, None, method="elbo",
                                      mask_id=MASK_ID, masks=masks, return_details=True)

    old = jax.lax.stop_gradient(estimates(params, den_masks))
    old_sum = estimators.combine(old.token_logp, den_masks, "sum")
    old_mean = estimators.combine(old.token_logp, den_masks, "mean")

    def objective_loss(p, name):
      new = estimates(p, num_masks)
      new_sum = estimators.combine(new.token_logp, num_masks, "sum")
      new_mean = estimators.combine(new.token_logp, num_masks, "mean")
      if name == "grpo (sequence)":
        # PPO's usual symmetric clip of 0.2 (d1's is 0.5: objectives/grpo.py).
        return objectives.grpo.grpo_loss(new_sum, old_sum, adv, epsilon_low=0.2,
                                         epsilon_high=0.2)[0]
      if name == "espo":
        return objectives.espo.espo_loss(new_sum, old_sum, adv, GEN_LEN)[0]
      return objectives.stabledrl.stabledrl_loss(new_mean, new_mean - old_mean, adv, GROUP)[0]

    out = {}
    for name in ["grpo (sequence)", "espo", "stabledrl"]:
      grads = jax.grad(objective_loss)(params, name)
      out[name] = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    new = estimates(params, num_masks)
    log_ratio = estimators.combine(new.token_logp, num_masks, "sum") - old_sum
    out["max_log10_ratio"] = jnp.max(log_ratio) / math.log(10)
    return out

  return step


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--draws", type=int, default=16)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--output", default=None, help="optional JSON file for the table")
  args = parser.parse_args()

  params = init_params(jax.random.key(args.seed))
  results = {}
  start = time.perf_counter()
  for condition in ["independent", "stress"]:
    step = make_step(condition)
    draws = [jax.device_get(step(params, k))
             for k in jax.random.split(jax.random.key(args.seed + 1), args.draws)]
    for name in ["grpo (sequence)", "espo", "stabledrl"]:
      norms = np.array([d[name] for d in draws])
      finite = norms[np.isfinite(norms)]
      results[f"{name}/{condition}"] = {
          "grad_norm_median": float(np.median(finite)) if finite.size else math.inf,
          "grad_norm_max": float(finite.max()) if finite.size else math.inf,
          "non_finite_frac": float(1 - finite.size / norms.size),
          "max_log10_ratio": float(max(d["max_log10_ratio"] for d in draws))}

  print(f"{'objective/condition':<30} {'grad norm median':>17} {'max (finite)':>13} "
        f"{'non-finite':>11} {'max log10 rho':>14}")
  for key, row in results.items():
    print(f"{key:<30} {row['grad_norm_median']:>17.4g} {row['grad_norm_max']:>13.4g} "
          f"{row['non_finite_frac']:>11.0%} {row['max_log10_ratio']:>14.2f}")
  print(f"({args.draws} draws per condition, {time.perf_counter() - start:.1f} s)")
  if args.output:
    with open(args.output, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
