"""Joining the job: world size from the launcher's environment, this rank's device, the process group.

torchrun, `megascale train --nproc N` and srun-with-torchrun all export RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; `init_process_group` reads them. The ranks meet in torch's TCPStore at
MASTER_ADDR:MASTER_PORT, or, with `parallel.store = "redis://..."`, in a Redis server (paper §3.5;
`megascale.stores.redis_store`). The backend follows the device: gloo on CPU; on an accelerator its
own backend (NCCL on CUDA) with gloo kept for CPU tensors. The accelerator branch cannot run on this
project's CPU-only machines and is untested.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megascale.config import ParallelConfig
from megascale.errors import ConfigError
from megascale.parallel.dims import ParallelDims


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
        assert accelerator is not None  # there is one: is_available() found it
        return torch.device(accelerator.type, int(os.environ.get("LOCAL_RANK", "0")))
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"config: training.device = {name!r} is not a device; use 'auto', 'cpu' or 'cuda'"
        ) from None


# c10d keeps only the C++ side of a Python store alive: the Python object must outlive every process group.
_redis_store = None


def rendezvous_prefix() -> str:
    """Where this launch's rendezvous keys go in a store shared by jobs and restarts.

    The launcher's run id names the launch (`megascale launch`: the job and its attempt; `megascale train
    --nproc`: a fresh id; torchrun: --rdzv-id), and torchrun's restart count the generation, so restarted
    workers never read the addresses of the attempt before (docs/resilience.md, "The store"). Without a
    run id (RANK/WORLD_SIZE set by hand, or torchrun's default 'none') the master address stands in."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id == "none":
        run_id = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    return f"megascale/pg/{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def init_distributed(device: torch.device, timeout_s: float, store: str = "env") -> None:
    """Create the default process group from the environment, unless one exists or the job has one rank.

    The timeout bounds every collective: a hung peer fails the others after `timeout_s`, not after
    torch's default 30 minutes (a dead peer fails them at once). `store` is `parallel.store`: 'env'
    (torch's TCPStore at MASTER_ADDR:MASTER_PORT) or redis://HOST:PORT/DB, whose keys go under
    `rendezvous_prefix()`; the same timeout bounds every wait in the store."""
    if dist.is_initialized() or env_world_size() == 1:
        return
    if device.type == "cpu":
        backend = "gloo"
    else:  # untested: no accelerator here
        torch.accelerator.set_device_index(device.index or 0)
        backend = f"{device.type}:{dist.get_default_backend_for_device(device)},cpu:gloo"
    timeout = timedelta(seconds=timeout_s)
    if store == "env":
        dist.init_process_group(backend, timeout=timeout)
        return
    from megascale.stores.redis_store import RedisStore  # redis only for jobs that ask for it

    global _redis_store
    _redis_store = RedisStore(store, prefix=rendezvous_prefix(), timeout=timeout)
    dist.init_process_group(
        backend,
        store=_redis_store,
        rank=int(os.environ["RANK"]),
        world_size=env_world_size(),
        timeout=timeout,
    )


def join_job(device: torch.device, dims: ParallelDims, par: ParallelConfig) -> None:
    """This process's part in the job: the default process group and, with more than one process, the
    layout's mesh (`dims.mesh`), every collective bounded by `parallel.timeout_s`."""
    init_distributed(device, par.timeout_s, store=par.store)
    if dims.world_size > 1:
        dims.build_mesh(device.type, par.timeout_s)


def close_distributed() -> None:
    """Destroy the default process group, if this process has one. After a run that ended normally: NCCL
    warns at exit about a group left alive (gloo does not mind); a rank that fails leaves through its
    exception instead, without waiting on peers that may be gone."""
    global _redis_store
    if dist.is_initialized():
        dist.destroy_process_group()
    _redis_store = None
