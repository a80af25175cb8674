"""Whether the model's blocks are compiled when `training.compile` is unset: where it was measured to win.

torch.compile fuses each block's element-wise work around its matmuls and attention. On CPU it made the
default model's bfloat16 step take 13% less CPU time (0.44 against 0.50 s a step on 2 threads, and 0.24
against 0.28 s of wall time in `megascale train`), and its float32 step none (1.03 against 1.03 s), where
the matmuls and the float32 attention kernel are the step. Compiling costs once: about 15 s on a cold
cache, about 2 s once torch's on-disk caches (inductor's FX graph cache and AOTAutograd's, both on by
default, under /tmp/torchinductor_$USER) hold the block, so a bfloat16 run of the default shape wins it
back after ~60 steps on a warm cache and ~420 on a cold one. Unset, the blocks are therefore compiled for
a CPU run in bfloat16 of AUTO_MIN_STEPS steps or more (`training.steps`, or `stop_at_step` if it stops
earlier), of a dense model, in a layout that allows it
(`ParallelDims.validate` with compile on); an accelerator and MoE layers stay eager, as nothing measured
them. The speed-up was measured in one process; under data, pipeline and context parallelism the same
blocks are compiled, which the parity matrix's compiled rows train to one process's losses.
`training.compile = true / false` decides outright.
"""

from __future__ import annotations

import dataclasses

from megascale.config import JobConfig
from megascale.errors import ConfigError
from megascale.parallel.dims import ParallelDims

AUTO_MIN_STEPS = 100  # steps a run needs for an unset training.compile to compile (above)


def compiles(cfg: JobConfig, dims: ParallelDims, device_type: str) -> bool:
    """`training.compile`, or where it is unset, whether compiling wins for this run (module docstring)."""
    training = cfg.training
    if training.compile is not None:
        return training.compile
    steps = min(training.steps, training.stop_at_step or training.steps)  # what this run may train
    if device_type != "cpu" or training.dtype != "bfloat16" or steps < AUTO_MIN_STEPS:
        return False
    if cfg.model.moe.experts:
        return False
    compiled = dataclasses.replace(cfg, training=dataclasses.replace(training, compile=True))
    try:
        dims.validate(compiled, dims.world_size)
    except ConfigError:
        return False
    return True
