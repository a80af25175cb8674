"""Learning-rate schedule: linear warm-up to the peak, then cosine, linear or no decay.

The schedule is a pure function of the step, used as a LambdaLR factor, so the scheduler's state is a
single step counter and a resumed run follows exactly the curve of an uninterrupted one.
"""

import math

DECAYS = ("cosine", "linear", "constant")


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float) -> float:
    """The learning rate of optimizer step `step` (0-based) as a fraction of the peak.

    Warm-up reaches 1.0 at step warmup_steps - 1; decay then reaches min_lr_ratio at step total_steps - 1.
    """
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps - 1)
    progress = min(max(progress, 0.0), 1.0)
    if decay == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if decay == "linear":
        return 1 - (1 - min_lr_ratio) * progress
    return 1.0
