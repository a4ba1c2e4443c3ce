"""torch.distributed environment for the trainer: one process by default, torchrun when launched by it.

`init()` reads torchrun's variables (WORLD_SIZE, RANK, LOCAL_RANK), starts the process group
(nccl on CUDA, gloo on CPU) and says how to shard each step's rows: every rank takes a contiguous
slice of the step's `batch_size` rows, so N processes together see exactly the rows one would.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    enabled: bool = False
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    device: torch.device | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, rows: list) -> list:
        if not self.enabled:
            return rows
        per = -(-len(rows) // self.world_size)
        return rows[self.rank * per:(self.rank + 1) * per]

    def all_reduce_int(self, value: int) -> int:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self._reduce_device())
        dist.all_reduce(t)
        return int(t.item())

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return tensor
        t = tensor.clone().to(self._reduce_device())
        dist.all_reduce(t)
        return t.to(tensor.device)

    def _reduce_device(self) -> torch.device:
        return self.device if self.device is not None and self.device.type == "cuda" else torch.device("cpu")

    def wrap(self, module: torch.nn.Module, plan: dict) -> torch.nn.Module:
        """The training forward, wrapped for the world: unchanged in one process."""
        if not self.enabled:
            return module
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device is not None and self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids)

    def shutdown(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def init() -> DistEnv:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistEnv(True, world, rank, local, device)
