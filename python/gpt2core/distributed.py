"""Process-group facts from the launcher's environment (torchrun, SLURM, mpirun, or none)."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def from_env(environ=None) -> DistEnv:
    """Read RANK/LOCAL_RANK/WORLD_SIZE (torchrun), SLURM_PROCID/..., or OMPI_COMM_WORLD_*."""
    env = os.environ if environ is None else environ
    for r, lr, ws in (("RANK", "LOCAL_RANK", "WORLD_SIZE"),
                      ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
                      ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")):
        if ws in env:
            try:
                d = DistEnv(rank=int(env.get(r, 0)), local_rank=int(env.get(lr, 0)), world_size=int(env[ws]))
            except ValueError as e:
                raise ValueError(f"bad distributed environment ({r}/{lr}/{ws}): {e}") from None
            if not (0 <= d.rank < d.world_size):
                raise ValueError(f"{r}={d.rank} is outside 0..{ws}-1 ({d.world_size})")
            return d
    return DistEnv()
