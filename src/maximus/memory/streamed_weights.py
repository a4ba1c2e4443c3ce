"""How big the streamed layers are, and whether this machine can hold them where the run says.

`optimization.offload.params` keeps every decoder layer's frozen weights off the device: in host
memory (``on``, pinned where CUDA exists) or in a file under the cache (``disk``). These figures
are the planner's (host and disk bytes) and the trainer's check before anything loads
(`check_stream_capacity`: one line naming what is needed and what the machine has). With them
the input embedding's table stays in host memory (`embedding_stays_on_host` decides, for the
estimator and `maximus.memory.host_embedding` alike; `host_embedding_bytes` is its size).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from maximus.errors import ConfigError

__all__ = ["NF4_BYTES_PER_WEIGHT", "STAGING_LAYERS", "STREAMED_IN_FLIGHT", "check_stream_capacity",
           "embedding_stays_on_host", "host_embedding_bytes", "streamed_layer_bytes"]

#: Layers whose weights are on the device at once: the running one, the prefetched one, and in
#: backward the one just finished (`FrozenWeightStreamer`).
STREAMED_IN_FLIGHT = 3
#: Pinned staging buffers a disk store reads layers into on CUDA (`DiskWeightStore`).
STAGING_LAYERS = 2

#: NF4 with double quantization: 4 bits per weight, a uint8 absmax per 64 weights, a float32 absmax
#: per 256 of those (bitsandbytes' `quantize_4bit`, ``compress_statistics=True``).
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)
#: Per 4-bit linear layer beyond that: the 16-value NF4 code, the offset, the 256-value nested code (float32).
NF4_FIXED_BYTES = 16 * 4 + 4 + 256 * 4


def streamed_layer_bytes(shape, method: str, dtype_bytes: int) -> int:
    """Bytes one decoder layer's streamed weights take off the device: the 4-bit weights with
    their quantization state (QLoRA) or the frozen weights at the compute dtype (LoRA), and the
    norms and biases. `shape`: a `maximus.memory.estimate.ModelShape`."""
    other = shape.layer_other_params * dtype_bytes
    if method == "qlora":
        linears = len(shape.linear_shapes())
        return int(shape.layer_linear_params * NF4_BYTES_PER_WEIGHT) + linears * NF4_FIXED_BYTES + other
    if method == "lora":
        return shape.layer_linear_params * dtype_bytes + other
    return 0


def embedding_stays_on_host(*, streams_params: bool, method: str, tied: bool, trained: bool) -> bool:
    """Whether the input embedding's table lives in host memory and only a batch's rows reach the
    device (`maximus.memory.host_embedding`): with streamed frozen weights, an adapter method, a
    table the output head does not share (tied, the head reads all of it) and that nothing trains
    (`lora.modules_to_save`: its gradient and optimizer state are the whole table's)."""
    return streams_params and method != "full" and not tied and not trained


def host_embedding_bytes(shape, method: str, dtype_bytes: int, *, trained: bool = False) -> int:
    """Bytes of the input embedding's table kept in host memory with streamed weights: vocabulary x
    hidden at the compute dtype, or 0 where it stays on the device (`embedding_stays_on_host`)."""
    if not embedding_stays_on_host(streams_params=True, method=method, tied=shape.tied_embeddings, trained=trained):
        return 0
    return shape.embedding_params * dtype_bytes


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_stream_capacity(mode: str, needed_bytes: int, *, host_available: int, cache_dir: Path,
                          cached: bool = False) -> None:
    """Refuse, before loading, a stream this machine cannot hold.

    ``on``: the streamed layers live in host memory: `needed_bytes` must fit in `host_available`.
    ``disk``: they live in a file under `cache_dir` (nothing to write when it is `cached`).
    Raises `ConfigError` naming both figures."""
    if mode == "on" and needed_bytes > host_available:
        free_disk = _free_disk(cache_dir)
        raise ConfigError(
            f"optimization.offload.params: on needs {_gib(needed_bytes)} of host memory for the streamed layers; "
            f"this machine has {_gib(host_available)} available",
            f"use offload.params: disk ({_gib(free_disk)} free under {cache_dir}) or a machine with more memory")
    if mode == "disk" and not cached:
        free_disk = _free_disk(cache_dir)
        if needed_bytes > free_disk:
            raise ConfigError(
                f"optimization.offload.params: disk needs {_gib(needed_bytes)} of free disk under {cache_dir} for "
                f"the streamed layers; it has {_gib(free_disk)} free",
                "free space there, or point MAXIMUS_CACHE at a larger disk")


def _free_disk(directory: Path) -> int:
    """Free bytes on the file system that holds `directory` (or its nearest existing parent)."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free
