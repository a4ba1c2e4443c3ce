"""One memory meter for every device: current and peak bytes, and a breakdown by category.

* CUDA: the caching allocator's own counters (`torch.cuda.memory_allocated`,
  `torch.cuda.max_memory_allocated`), so the numbers are what the allocator handed out.
* CPU (and any other device): a tracker of live tensor storages. While `meter.track()` is
  active, a `TorchDispatchMode` sees every op's outputs and records each new storage once
  (by storage identity; views, detaches and in-place ops are skipped by their schema, since
  their outputs alias an input); a weak reference on the
  storage lowers the count the moment the storage is freed, even after tracking stopped.
  Tensors created before tracking (parameters, optimizer state) are counted once they are
  `adopt`-ed (`meter.track(model, optimizer)` adopts them on entry).

The CPU tracker does not see scratch buffers that kernels allocate internally and free before
returning (e.g. a matmul's packing workspace); those are the "allocator rounding" of the CPU.

Example::

    meter = MemoryMeter("cpu")
    with meter.track(model, optimizer):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
    print(meter.peak_bytes(), meter.breakdown(model, optimizer))
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["MemoryMeter", "StorageTracker", "measure_step_peak", "unique_storage_bytes"]


#: Ops whose output aliases a tensor made outside the dispatcher (``torch.tensor(...)`` goes
#: through ``lift_fresh``): that storage was never seen, so it is counted here.
_FRESH_ALIASES = frozenset({"aten::lift_fresh", "aten::lift"})


def _returns_alias(func) -> bool:
    """Whether every output of the aten op `func` aliases an input (views, ``detach``, in-place
    and ``out=`` ops): such outputs never own a new storage."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.returns or schema.name in _FRESH_ALIASES:
        return False
    return all(r.alias_info is not None for r in schema.returns)


def _storage_of(t: torch.Tensor):
    """The untyped storage behind a dense tensor, or None (meta, sparse, nested, fake)."""
    if type(t) is not torch.Tensor and isinstance(t, _dtensor_type()):  # an FSDP2 shard: count this rank's local piece
        t = t.to_local()
    if t.is_meta or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


@functools.cache
def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def _tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor held by a module (parameters, buffers, grads, bitsandbytes quant states), an
    optimizer (its state) or a (nested) container of tensors."""
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
        quant_state = getattr(obj, "quant_state", None)  # bitsandbytes Params4bit: absmax & co.
        if quant_state is not None:
            yield from _quant_state_tensors(quant_state)
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield from _tensors_of(p)
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            for v in tree_leaves(state):
                if (isinstance(v, torch.Tensor) and type(v) is not torch.Tensor and hasattr(v, "__tensor_flatten__")
                        and type(v).__name__ != "DTensor"):  # FSDP2's sharded state is counted as before
                    inner = (getattr(v, n) for n in v.__tensor_flatten__()[0])  # torchao's 4-bit moments
                    yield from (t for t in inner if isinstance(t, torch.Tensor))
                elif isinstance(v, torch.Tensor):
                    yield v
                elif hasattr(v, "__dict__"):  # APOLLO / GaLore projector objects
                    yield from (t for t in vars(v).values() if isinstance(t, torch.Tensor))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_of(v)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors_of(v)


def _quant_state_tensors(quant_state) -> Iterator[torch.Tensor]:
    for name in ("absmax", "code"):
        t = getattr(quant_state, name, None)
        if isinstance(t, torch.Tensor):
            yield t
    nested = getattr(quant_state, "state2", None)
    if nested is not None:
        yield from _quant_state_tensors(nested)


def unique_storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] | None = None) -> tuple[int, set[int]]:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once).

    Returns (bytes, set of storage data pointers seen); storages whose data pointer is in
    `exclude` are skipped, so categories can be summed without double counting.
    """
    seen: set[int] = set()
    total = 0
    exclude = exclude or set()
    for t in tensors:
        st = _storage_of(t)
        if st is None:
            continue
        ptr = st.data_ptr()
        if ptr == 0 or ptr in seen or ptr in exclude:
            continue
        seen.add(ptr)
        total += st.nbytes()
    return total, seen


class StorageTracker(TorchDispatchMode):
    """Counts live bytes of tensor storages created while the mode is active (CPU meter).

    Each storage is recorded once, keyed by identity; a weakref callback subtracts its bytes when
    it dies. `current_bytes` / `peak_bytes` are in bytes.
    """

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        # `t.device` builds a torch.device (and its string) on every call; `t.is_cpu` and its
        # siblings are plain attribute reads. Other device types fall back to the comparison.
        flag = f"is_{device_type}"
        self._on_device = (lambda t: getattr(t, flag)) if hasattr(torch.Tensor, flag) else (
            lambda t: t.device.type == device_type)
        self._aliasing: dict[Any, bool] = {}  # op -> whether its outputs alias an input (views, detach, in-place)
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, weakref.ref] = {}  # id(storage) -> weak reference to it
        self._sizes: dict[weakref.ref, tuple[int, int]] = {}  # weak reference -> (id, bytes)

    # -- bookkeeping ---------------------------------------------------------------------------
    def _on_free(self, ref: weakref.ref) -> None:
        key, nbytes = self._sizes.pop(ref)
        del self._live[key]
        self.current_bytes -= nbytes

    def record(self, t: torch.Tensor) -> None:
        """Count `t`'s storage if it lives on the tracked device type and is not counted yet."""
        if not self._on_device(t):
            return
        st = _storage_of(t)
        if st is None:
            return
        key = id(st)
        if key in self._live:
            return
        nbytes = st.nbytes()
        if nbytes == 0:
            return
        ref = weakref.ref(st, self._on_free)
        self._live[key] = ref
        self._sizes[ref] = (key, nbytes)
        self.current_bytes += nbytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    # -- the mode ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliasing = self._aliasing.get(func)
        if aliasing is None:
            aliasing = self._aliasing[func] = _returns_alias(func)
        if aliasing:  # a view, detach or in-place op: its storage is an input's, counted already
            return out
        if isinstance(out, torch.Tensor):
            self.record(out)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self.record(t)
                elif isinstance(t, (tuple, list)):
                    for u in tree_leaves(t):
                        if isinstance(u, torch.Tensor):
                            self.record(u)
        return out


class MemoryMeter:
    """Current and peak memory of one device, in bytes, plus a breakdown by category.

    Args:
        device: ``"cuda"``, ``"cuda:1"``, ``"cpu"``, a `torch.device`, ...
        budget_bytes: the memory budget the run must stay under (optional); `over_budget_bytes`
            says how far the peak went past it, which the trainer re-plans on.
    """

    def __init__(self, device: str | torch.device = "cpu", budget_bytes: int | None = None):
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self._cuda = self.device.type == "cuda"
        self._tracker = None if self._cuda else StorageTracker(self.device.type)
        self._adopted: set[int] = set()  # ids of modules / optimizers already walked

    # -- readings ------------------------------------------------------------------------------
    def current_bytes(self) -> int:
        """Bytes held by live tensors now."""
        if self._cuda:
            return int(torch.cuda.memory_allocated(self.device))
        return self._tracker.current_bytes

    def peak_bytes(self) -> int:
        """Highest `current_bytes` since the meter was made or `reset_peak` was last called."""
        if self._cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._tracker.peak_bytes

    def over_budget_bytes(self) -> int:
        """Bytes by which the peak of this window exceeds `budget_bytes`; 0 when within it or
        when there is no budget."""
        if not self.budget_bytes:
            return 0
        return max(0, self.peak_bytes() - int(self.budget_bytes))

    def reset_peak(self) -> None:
        """Start a new peak window at the current level."""
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._tracker.reset_peak()

    # -- tracking ------------------------------------------------------------------------------
    def adopt(self, *objects: Any) -> None:
        """Count tensors that already exist (a module's parameters, buffers and grads, an
        optimizer's state, tensors) on the CPU tracker. A no-op on CUDA, whose allocator already
        counts everything."""
        if self._cuda:
            return
        for obj in objects:
            for t in _tensors_of(obj):
                self._tracker.record(t)

    def _adopt_once(self, objects: tuple) -> None:
        # Walking a model's parameters every step costs more than the step's bookkeeping, and
        # what a model or optimizer creates later is created inside `track` and seen there.
        fresh = [o for o in objects if id(o) not in self._adopted]
        self.adopt(*fresh)
        self._adopted.update(id(o) for o in fresh if isinstance(o, (torch.nn.Module, torch.optim.Optimizer)))

    @contextlib.contextmanager
    def track(self, *objects: Any):
        """Count every storage created inside the block (CPU); `objects` (a model, an optimizer,
        tensors) are adopted the first time they are passed.

        The trainer wraps each step in it. On CUDA this is free: the allocator counts.
        Tensors a model or optimizer gains outside any `track` block after its first adoption
        (e.g. a state loaded on resume) are counted after `adopt` is called for it again.
        """
        if self._cuda:
            yield self
            return
        self._adopt_once(objects)
        with self._tracker:
            yield self

    @contextlib.contextmanager
    def paused(self):
        """Inside a `track` block (CPU): run this block without the tracker, so its ops cost no
        Python call each (a decode loop of thousands of small ops ran 2.5x slower tracked); the
        storages it makes are not counted, so the caller reports what the block holds with
        `hold`. A no-op on CUDA, outside `track`, and in another thread (the mode is per thread)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

        if self._cuda or _get_current_dispatch_mode() is not self._tracker:
            yield self
            return
        with _pop_mode_temporarily():
            yield self

    def hold(self, nbytes: int) -> None:
        """Count `nbytes` held outside the tracker right now (in a `paused` block) on top of the
        tracked bytes, for the peak (CPU; on CUDA the allocator counts them already)."""
        if not self._cuda:
            self._tracker.peak_bytes = max(self._tracker.peak_bytes, self._tracker.current_bytes + int(nbytes))

    # -- categories ----------------------------------------------------------------------------
    def breakdown(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes by category: parameters (incl. buffers and 4-bit quantisation state),
        gradients, optimizer_state, activations (peak minus those three: activations, loss and
        temporaries at the peak moment), plus `current` and `peak`.

        Categories are measured now, so call it right after the step whose peak you want split.
        """
        params, seen = 0, set()
        grads = opt = 0
        if model is not None:
            weights = []
            grad_tensors = []
            for p in model.parameters():
                weights.append(p)
                if p.grad is not None:
                    grad_tensors.append(p.grad)
                qs = getattr(p, "quant_state", None)
                if qs is not None:
                    weights.extend(_quant_state_tensors(qs))
            weights.extend(model.buffers())
            params, seen = unique_storage_bytes(weights)
            grads, g_seen = unique_storage_bytes(grad_tensors, exclude=seen)
            seen |= g_seen
        if optimizer is not None:
            opt, _ = unique_storage_bytes(_tensors_of(optimizer), exclude=seen)
        peak = self.peak_bytes()
        return {
            "parameters": params,
            "gradients": grads,
            "optimizer_state": opt,
            "activations": max(0, peak - params - grads - opt),
            "current": self.current_bytes(),
            "peak": peak,
        }


def measure_step_peak(step, *objects: Any, device: str | torch.device = "cpu", warmup: int = 1) -> tuple[int, "MemoryMeter"]:
    """Peak bytes of one call of ``step()`` in steady state.

    Runs ``step()`` `warmup` times first (so optimizer state and caches exist, as in every later
    step), then once more in a fresh peak window. `objects` (model, optimizer) are adopted so
    that the peak includes what they hold. Returns (peak bytes, the meter) so the caller can ask
    for `breakdown`.
    """
    meter = MemoryMeter(device)
    for _ in range(warmup):
        with meter.track(*objects):
            step()
    meter.reset_peak()
    with meter.track(*objects):
        step()
    return meter.peak_bytes(), meter
