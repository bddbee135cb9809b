"""A user's reward term that fails on two completions of a run (for tests/test_train.py, named under
`plugins:`): it raises on the first training completion it scores and returns NaN on the second;
every other completion, evaluation's included, scores 1.0. It runs in the trainer's process."""
import math

from grpo.rewards import register_term

scored = [0]  # training completions scored in this process


@register_term("flaky", range=(0.0, 1.0), equation="1; raises on the run's first training completion, NaN on its second")
def flaky(c, cfg) -> float:
    if not str(getattr(c.problem, "id", "")).startswith("arithmetic-train"):
        return 1.0
    scored[0] += 1
    if scored[0] == 1:
        raise RuntimeError("an odd completion")
    return math.nan if scored[0] == 2 else 1.0
