"""Joining the job: world size from the launcher's environment, this rank's device, the process group.

torchrun, `megascale train --nproc N` and srun-with-torchrun all export RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; `init_process_group` reads them. The backend follows the device: gloo on CPU;
on an accelerator its own backend (NCCL on CUDA) with gloo kept for CPU tensors. The accelerator branch
cannot run on this project's CPU-only machines and is untested.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megascale.errors import ConfigError


def env_world_size() -> int:
    """The job's world size: the live process group's, else the launcher's WORLD_SIZE, else 1."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(name: str) -> torch.device:
    """'auto' is this rank's accelerator (index LOCAL_RANK) if the machine has one, else the CPU."""
    if name == "auto":
        if not torch.accelerator.is_available():
            return torch.device("cpu")
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type, int(os.environ.get("LOCAL_RANK", "0")))
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"config: training.device = {name!r} is not a device; use 'auto', 'cpu' or 'cuda'"
        ) from None


def init_distributed(device: torch.device, timeout_s: float) -> None:
    """Create the default process group from the environment, unless one exists or the job has one rank.

    The timeout bounds every collective: a hung peer fails the others after `timeout_s`, not after
    torch's default 30 minutes (a dead peer fails them at once)."""
    if dist.is_initialized() or env_world_size() == 1:
        return
    if device.type == "cpu":
        backend = "gloo"
    else:  # untested: no accelerator here
        torch.accelerator.set_device_index(device.index or 0)
        backend = f"{device.type}:{dist.get_default_backend_for_device(device)},cpu:gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
