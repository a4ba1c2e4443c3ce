"""Where streamed decoder-layer weights live between uses: host memory or a file on disk.

`FrozenWeightStreamer` copies each layer's frozen storages (plain weights, and 4-bit packed data
with every tensor of its quantization state) from a store to the device one layer ahead of use.

* `HostWeightStore` (``offload.params: on``): one host copy per storage, pinned when CUDA exists,
  so that host-to-device copies run asynchronously on a side stream.
* `DiskWeightStore` (``offload.params: disk``): one file of raw bytes (``layers.bin``, each
  storage at a page-aligned offset) with a JSON manifest, in a directory under
  ``$MAXIMUS_CACHE/streamed-weights/`` named by the model and quantization (`streamed_cache_dir`).
  The file is memory-mapped. A background thread reads the layer after next while the next one
  is copied: on CUDA into one of a few pinned staging buffers, on CPU by asking the kernel to
  read it into the page cache. A layer's mapped pages are dropped from the process
  (``MADV_DONTNEED``) once copied, so the process never holds the file in its resident memory:
  the page cache serves it. Written once (the data file and then the manifest, each renamed into
  place, so a run killed while writing leaves no cache that looks complete) and reused by later
  runs with the same `fingerprint`.

Every store answers `host_tensors(i)` with the tensors `put(i, ...)` was given, shaped and typed
as they were, ready to copy from.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

__all__ = ["DiskWeightStore", "HostWeightStore", "streamed_cache_dir"]

FORMAT_VERSION = 1
_PAGE = mmap.PAGESIZE
_ALIGN = 64  # bytes between tensors in a pinned staging buffer
_DTYPES = {str(t): t for t in (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.float64,
                               torch.int32, torch.int64, torch.bool)}


def streamed_cache_dir(fingerprint: dict[str, Any]) -> Path:
    """The cache directory of one model + quantization: ``$MAXIMUS_CACHE/streamed-weights/<hash>``."""
    from maximus.files import cache_root

    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "streamed-weights" / digest


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a flat uint8 host tensor (a view when `t` is already a contiguous host tensor)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def _aligned(nbytes: int, to: int) -> int:
    return -(-nbytes // to) * to


class HostWeightStore:
    """Host copies of each layer's streamed tensors (pinned when `pin`)."""

    kind = "host"

    def __init__(self, pin: bool):
        self.pin = pin
        self._layers: dict[int, list[torch.Tensor]] = {}
        self.nbytes = 0

    def has(self, i: int) -> bool:
        return i in self._layers

    def put(self, i: int, tensors: list[torch.Tensor]) -> None:
        copies = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
            host.copy_(t.detach())
            copies.append(host)
            self.nbytes += host.untyped_storage().nbytes()
        self._layers[i] = copies

    def commit(self, extra: dict[str, Any] | None = None) -> None:
        """Nothing to do: host copies are complete when `put` returns."""

    def signature(self, i: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(tuple(t.shape), t.dtype) for t in self._layers[i]]

    def host_tensors(self, i: int) -> list[torch.Tensor]:
        return self._layers[i]

    def read_ahead(self, i: int) -> None:
        """Nothing to do: host memory is already where copies start."""

    def done(self, i: int, ready: Any = None) -> None:
        """Nothing to do: the host copies stay."""

    def close(self) -> None:
        self._layers.clear()


class DiskWeightStore:
    """Each layer's streamed tensors in one memory-mapped file, read ahead by a background thread.

    Writing: `put(i, tensors)` for each layer in order, then `commit(extra)`. Reading: `open()`
    (True when a complete cache written for `fingerprint` is there), then `host_tensors(i)`,
    `read_ahead(i)` and `done(i)`. `pin`: stage reads in pinned buffers (for CUDA copies)."""

    kind = "disk"

    def __init__(self, directory: Path, fingerprint: dict[str, Any], pin: bool):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.pin = pin
        self.data_path = self.directory / "layers.bin"
        self.manifest_path = self.directory / "manifest.json"
        self.layers: list[list[dict]] = []  # per layer: {offset, nbytes, dtype, shape} per tensor
        self.extra: dict[str, Any] = {}
        self.nbytes = 0
        self.reused = False
        self._writer = None
        self._tmp: Path | None = None
        self._map: mmap.mmap | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        self._staged: dict[int, list[torch.Tensor]] = {}
        self._returned: deque = deque()  # (pinned slot, CUDA event after which it is free)

    # -- writing -------------------------------------------------------------------------------
    def _begin(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob("*.tmp-*"):
            if not _alive(stale.name.rsplit("-", 1)[-1]):
                stale.unlink()  # left by a run of ours that was killed while writing this cache
        self._tmp = self.directory / f"layers.bin.tmp-{os.getpid()}"
        self._writer = open(self._tmp, "wb")
        self.layers, self.nbytes = [], 0

    def put(self, i: int, tensors: list[torch.Tensor]) -> None:
        if self._writer is None:
            self._begin()
        if i != len(self.layers):
            raise ValueError(f"layers are written in order: expected layer {len(self.layers)}, got {i}")
        entries = []
        for t in tensors:
            offset = self._writer.tell()
            data = _bytes_of(t)
            if data.numel():
                # Through ctypes, not `.numpy()`: a storage shared with NumPy can no longer be resized,
                # and the streamer releases it by resizing.
                self._writer.write((ctypes.c_char * data.numel()).from_address(data.data_ptr()))
            self._writer.write(b"\0" * (-self._writer.tell() % _PAGE))
            entries.append({"offset": offset, "nbytes": int(data.numel()), "dtype": str(t.dtype),
                            "shape": list(t.shape)})
            self.nbytes += int(data.numel())
        self.layers.append(entries)

    def commit(self, extra: dict[str, Any] | None = None) -> None:
        """Make the written file the cache: data first, manifest last (its presence says complete)."""
        if self._writer is None:
            self._begin()
        self.extra = dict(extra or {})
        self._writer.flush()
        os.fsync(self._writer.fileno())
        size = self._writer.tell()
        self._writer.close()
        self._writer = None
        os.replace(self._tmp, self.data_path)
        manifest = {"format": FORMAT_VERSION, "fingerprint": self.fingerprint, "file_bytes": size,
                    "layers": self.layers, "extra": self.extra}
        tmp = self.directory / f"manifest.json.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(json.dumps(manifest))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.manifest_path)
        self._open_map()

    # -- reading -------------------------------------------------------------------------------
    def open(self) -> bool:
        """Use the cache in `directory` if it is complete and was written for `fingerprint`."""
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except (OSError, ValueError):
            return False
        if (manifest.get("format") != FORMAT_VERSION or manifest.get("fingerprint") != self.fingerprint
                or not self.data_path.exists() or self.data_path.stat().st_size != manifest.get("file_bytes")):
            return False
        self.layers, self.extra = manifest["layers"], manifest.get("extra", {})
        self.nbytes = sum(e["nbytes"] for layer in self.layers for e in layer)
        self.reused = True
        self._open_map()
        return True

    def _open_map(self) -> None:
        with open(self.data_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # ACCESS_COPY: a private, writable mapping (torch.frombuffer wants a writable buffer);
            # nothing writes to it, so no page is ever copied.
            self._map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maximus-read-ahead")

    def has(self, i: int) -> bool:
        return i < len(self.layers)

    def signature(self, i: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(tuple(e["shape"]), _DTYPES[e["dtype"]]) for e in self.layers[i]]

    def _views(self, i: int) -> list[torch.Tensor]:
        """The layer's tensors as views of the mapped file (no copy; nothing read yet)."""
        out = []
        for e in self.layers[i]:
            dtype = _DTYPES[e["dtype"]]
            if e["nbytes"] == 0:
                out.append(torch.empty(e["shape"], dtype=dtype))
                continue
            flat = torch.frombuffer(self._map, dtype=torch.uint8, count=e["nbytes"], offset=e["offset"])
            out.append(flat.view(dtype).view(e["shape"]))
        return out

    def _span(self, i: int) -> tuple[int, int]:
        """(start, length) in the file of layer `i`'s tensors, whole pages."""
        entries = self.layers[i]
        if not entries or self._map is None:
            return 0, 0
        start = entries[0]["offset"]
        end = max(e["offset"] + e["nbytes"] for e in entries)
        return start, min(_aligned(end - start, _PAGE), len(self._map) - start)

    def _drop_pages(self, i: int) -> None:
        start, length = self._span(i)
        if length:
            self._map.madvise(mmap.MADV_DONTNEED, start, length)

    def _layer_slot_bytes(self, i: int) -> int:
        return sum(_aligned(e["nbytes"], _ALIGN) for e in self.layers[i])

    def _read(self, i: int) -> list[torch.Tensor] | None:
        """Bring layer `i` into memory (runs on the read-ahead thread)."""
        if not self.pin:
            start, length = self._span(i)
            if length:
                # The kernel reads the range into the page cache; the process maps none of it yet.
                self._map.madvise(mmap.MADV_WILLNEED, start, length)
            return None
        if self._returned:
            slot, copied = self._returned.popleft()
            if copied is not None:
                copied.synchronize()  # the copy that read this slot has ended
        else:
            largest = max(self._layer_slot_bytes(j) for j in range(len(self.layers)))
            slot = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
        staged, at = [], 0
        for v, e in zip(self._views(i), self.layers[i]):
            piece = slot[at:at + e["nbytes"]].view(v.dtype).view(v.shape) if e["nbytes"] else v
            piece.copy_(v)
            staged.append(piece)
            at += _aligned(e["nbytes"], _ALIGN)
        self._drop_pages(i)
        staged.append(slot)  # kept last so that `done` can hand the slot back
        return staged

    def read_ahead(self, i: int) -> None:
        if 0 <= i < len(self.layers) and i not in self._pending and i not in self._staged:
            self._pending[i] = self._reader.submit(self._read, i)

    def host_tensors(self, i: int) -> list[torch.Tensor]:
        if i in self._staged:
            return self._staged[i][:-1]
        future = self._pending.pop(i, None)
        staged = future.result() if future is not None else None
        if staged is None and self.pin:
            staged = self._read(i)
        if staged is None:
            return self._views(i)
        self._staged[i] = staged
        return staged[:-1]

    def done(self, i: int, ready: Any = None) -> None:
        """Layer `i` was copied to the device (`ready`: the CUDA event after which the copy has ended)."""
        staged = self._staged.pop(i, None)
        if staged is None:
            self._drop_pages(i)
        else:
            self._returned.append((staged[-1], ready))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self._pending.clear()
        self._staged.clear()
        self._returned.clear()


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
