"""``python -m stabledrl_jax.plan``: the plan command (``plan.cli``)."""

from stabledrl_jax.plan import cli

if __name__ == "__main__":
  cli.run()
