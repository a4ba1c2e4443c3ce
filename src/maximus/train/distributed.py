"""torch.distributed for the trainer: one process by default, DDP or FSDP2 when launched by torchrun.

`init()` reads torchrun's variables (WORLD_SIZE, RANK, LOCAL_RANK) and starts the process group
(nccl on CUDA, gloo on CPU) with a timeout, so a rank whose peer died stops instead of waiting
forever. The rest is what the trainer asks of the world:

- data: every rank takes a contiguous slice of each step's `batch_size` rows (`shard`), so N
  processes together see exactly the rows one would; the step's unit count is summed over ranks
  (`all_reduce_int`) and each rank scales its loss by world_size / units, so the gradient the
  ranks average is the gradient of the whole batch;
- model (`prepare_model`, before the optimizer is built): the strategy `maximus.memory.plan_run`
  chose from `training.distributed` = ``ddp``, ``fsdp`` or ``auto`` (FSDP2 when the model does not
  fit one device, else DDP). FSDP2 shards
  parameters, gradients and optimizer state with `torch.distributed.fsdp.fully_shard`: each
  decoder layer, the output head, then the decoder stack (embeddings, final norm) as the root.
  The lean loss reads the head's weight without a logits forward, so the head gets a forward
  method FSDP2 hooks (`forward.through_head`). A head tied to the embedding, and the head of a
  non-SFT objective, stay whole on every rank; trainable parameters outside FSDP (such a head, a
  tied embedding) have their gradients averaged across ranks by a hook. bitsandbytes
  4-bit weights cannot be sharded by `fully_shard`, so QLoRA runs under DDP (one-line notice);
- the training forward (`wrap`): DistributedDataParallel under DDP, unchanged under FSDP2 (its
  hooks live on the decoder modules);
- checkpoints (`checkpoint_view`): under FSDP2 every rank takes part in gathering the full
  trainable tensors and optimizer state (`DTensor.full_tensor`), rank 0 writes them in the
  one-process format; a checkpoint therefore resumes under any number of processes. Restoring
  copies full tensors into shards (inside `session()`, which lets whole tensors meet DTensors)
  and an optimizer load hook cuts the saved moments into this rank's shards.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from maximus.compat import ddp_leave_out
from maximus.errors import ConfigError
from maximus.memory.plan import Plan
from maximus.memory.spec_from_config import QLORA_FSDP_NOTICE  # noqa: F401 - the choice lives in the plan (fixed_strategy)

#: Seconds a collective may wait for a peer before the process group gives up (env
#: MAXIMUS_DIST_TIMEOUT_S). Long enough for rank 0 to write a large checkpoint while the others
#: wait at the next step, short enough that a dead peer does not hold the job for hours.
DEFAULT_TIMEOUT_S = 1800



@dataclass
class DistEnv:
    """Where this process stands in the world. `strategy` is ``single`` until `prepare_model`
    chooses ``ddp`` or ``fsdp``."""

    enabled: bool = False
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    device: torch.device | None = None
    strategy: str = "single"
    context_parallel: int = 1  # ranks that share each row (training.context_parallel); the rest split the batch
    _hooks: list = field(default_factory=list, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict:
        """What run.json records about the world."""
        return {"strategy": self.strategy, "world_size": self.world_size}

    # ------------------------------------------------------------------------------ data
    @property
    def data_world_size(self) -> int:
        """Processes that take different rows: the world over the ranks that share each row."""
        return self.world_size // self.context_parallel

    def shard(self, rows: list) -> list:
        """This rank's contiguous slice of one step's rows (all of them in one process); the ranks
        of one context-parallel group take the same slice."""
        if not self.enabled:
            return rows
        per = -(-len(rows) // self.data_world_size)
        at = self.rank // self.context_parallel
        return rows[at * per:(at + 1) * per]

    def check_batch(self, batch_size: int) -> None:
        """Every rank must get the same number of rows: a rank with fewer micro-batches would
        leave its peers waiting in a gradient collective."""
        n = self.data_world_size
        if self.enabled and batch_size % n:
            groups = f": {self.world_size} / context_parallel {self.context_parallel}" if self.context_parallel > 1 else ""
            raise ConfigError(f"training.batch_size ({batch_size}) must be a multiple of the number of processes "
                              f"({n}{groups})",
                              f"use a batch_size divisible by {n} or change --nproc_per_node")

    # ------------------------------------------------------------------------------ collectives
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

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on some rank (e.g. a stop signal arrived)."""
        return self.all_reduce_int(int(bool(flag))) > 0

    def all_ok(self, ok: bool) -> bool:
        """True on every rank only when it is true on every rank."""
        return self.all_reduce_int(int(not ok)) == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def _reduce_device(self) -> torch.device:
        return self.device if self.device is not None and self.device.type == "cuda" else torch.device("cpu")

    # ------------------------------------------------------------------------------ model
    def prepare_model(self, model: torch.nn.Module, cfg, plan: Plan, *, dtype: torch.dtype) -> str:
        """Set up the strategy the plan chose (`plan_run` decides DDP or FSDP2, once) and, for
        FSDP2, shard `model` in place. Call it after gradient checkpointing is applied and BEFORE
        the optimizer is built (FSDP2 replaces the parameters by sharded ones). Returns the
        strategy (``single`` in one process)."""
        if not self.enabled:
            return self.strategy
        self.check_batch(cfg.training.batch_size)
        strategy = "ddp" if plan.strategy == "single" else plan.strategy  # a 1-rank group: every rank whole
        if cfg.training.distributed == "fsdp" and strategy == "ddp" and plan.method == "qlora":
            self.say(QLORA_FSDP_NOTICE)
        if strategy == "fsdp":
            # The SFT and DPO losses run through `forward.through_head`, which gathers a sharded
            # head; the contrastive loss never reads the head, so it is left whole (and idle).
            self._hooks = shard_with_fsdp2(model, self.device, dtype, self.world_size,
                                           shard_head=plan.objective in ("sft", "dpo"))
        self.strategy = strategy
        return strategy

    def wrap(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> torch.nn.Module:
        """The training forward, wrapped for the world: DDP under ``ddp``, unchanged otherwise.
        Under FSDP2 `optimizer` gets a load hook that cuts whole saved moments into shards."""
        if self.strategy == "fsdp":
            if optimizer is not None:
                optimizer.register_load_state_dict_pre_hook(_shard_optimizer_state)
            return module
        if not self.enabled:
            return module
        if self.strategy == "single":  # prepare_model was not called: DDP, as before
            self.strategy = "ddp"
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device is not None and self.device.type == "cuda" else None
        # Frozen weights are the same files on every rank and DDP never reduces them: left out of its
        # start-up broadcast (a whole base model's copy; streamed layers hold no storage between
        # uses, and the host-kept embedding table is on the CPU, which DDP refuses to mix with CUDA).
        ddp_leave_out(module, [name for name, p in module.named_parameters() if not p.requires_grad])
        # No buffer a decoder keeps changes in forward (rotary tables are constant): skip the
        # per-forward broadcast.
        return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)

    @contextlib.contextmanager
    def session(self):
        """The span of training. Under FSDP2, whole tensors may meet DTensors (treated as
        replicated): checkpoint restore copies whole tensors into shards, and the replicated
        head's gradient joins the sharded ones in clipping and the optimizer step."""
        if self.strategy != "fsdp":
            yield self
            return
        from torch.distributed.tensor.experimental import implicit_replication

        with implicit_replication():
            yield self

    # ------------------------------------------------------------------------------ checkpoints
    def checkpoint_view(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
        """(model-like, optimizer-like) for `save_checkpoint`: the live objects when every rank
        holds whole tensors; under FSDP2 a `GatheredState` with the whole trainable tensors and
        optimizer state, in the one-process format, on rank 0 (None elsewhere). A collective
        under FSDP2: every rank must call it."""
        if self.strategy != "fsdp":
            return model, optimizer
        gathered = GatheredState(full_trainable_state(model, keep=self.is_main),
                                 full_optimizer_state(optimizer, keep=self.is_main) if optimizer is not None else None)
        return (gathered, gathered if optimizer is not None else None) if self.is_main else (None, None)

    # ------------------------------------------------------------------------------ output
    def say(self, text: str) -> None:
        """A one-line notice, printed by rank 0 only."""
        if self.is_main:
            print(text, file=sys.stderr, flush=True)

    def shutdown(self, *, clean: bool) -> None:
        """Leave the world: remove the gradient hooks and destroy the process group.

        After a clean finish (`clean`: training returned) every rank
        first waits at a barrier, so the ranks leave together. Without it a non-main rank reaches
        interpreter exit milliseconds after its last collective while rank 0 still writes the
        outputs, and a gloo worker thread may still be releasing a collective launched in backward
        (DDP's bucket all-reduce, FSDP2's reduce-scatter): the work holds the backward's Python
        context, releasing it takes the GIL, and a thread taking the GIL in a finalizing
        interpreter is ended by pthread_exit, which aborts the process ("terminate called without
        an active exception", SIGABRT: gloo's runLoop -> ~AsyncWork -> ~ThreadLocalState ->
        SafePyObject decref -> take_gil -> PyThread_exit_thread). The barrier waits with the GIL
        released, so those releases finish first. After an error there is no barrier: a
        peer may be stuck in a collective (the process group's timeout ends it), and a barrier
        that fails is ignored (the run's outcome is already decided)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if not (self.enabled and dist.is_initialized()):
            return
        if clean:
            try:
                dist.barrier()
            except RuntimeError:  # a peer already gone (torch's DistError is a RuntimeError): nothing left to wait for
                pass
        dist.destroy_process_group()
        global _LEFT
        _LEFT += 1


#: How many times a run in this process left the default process group (`DistEnv.shutdown`).
_LEFT = 0


def init() -> DistEnv:
    """The world torchrun describes in the environment (one process when WORLD_SIZE is unset)."""
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
        timeout = timedelta(seconds=float(os.environ.get("MAXIMUS_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
        if _LEFT == 0:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            # A later run in the same process (Trainer.train again): the default group's keys in
            # torchrun's store restart at `default_pg/0` once it is destroyed, so a rank could meet
            # the last run's stale address and wait forever. Each later run keys its group apart;
            # every rank runs the same sequence, so they agree on the prefix.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timeout)
            dist.init_process_group(backend=backend, store=dist.PrefixStore(f"maximus-run{_LEFT}", store), rank=rank,
                                    world_size=world, timeout=timeout)
    return DistEnv(True, world, rank, local, device)


# ---------------------------------------------------------------------------------- FSDP2
def shard_with_fsdp2(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, world_size: int, *,
                     shard_head: bool = True) -> list:
    """`fully_shard` each decoder layer, the output head, then the decoder stack as the root, in place.

    The lean loss reads `head.weight` outside any logits forward, so the head gets a second
    forward method (`forward.HEAD_FORWARD_METHOD`, registered with FSDP2) that the loss runs
    through (`forward.through_head`): the whole head exists only while the loss runs (and again
    in its backward), its gradient is reduce-scattered like the layers'. `shard_head=False` (an
    objective that reads the head without `through_head`) and a head tied to the embedding keep
    it whole on every rank (one weight cannot be in two FSDP units; the embedding's unit, the
    root, is gathered before the loss and its forward never reaches the head). Trainable
    parameters left outside FSDP get a gradient hook that averages them across ranks, as FSDP's
    reduce-scatter does for the rest. Mixed precision: parameters are gathered in the compute
    dtype, gradients reduced in fp32. Returns the hook handles."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from maximus.structure import causal_lm_of, find_decoder_layers

    stack, layers = find_decoder_layers(model)
    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else MixedPrecisionPolicy()
    head = causal_lm_of(model).get_output_embeddings()
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    ignored = {p for p in stack.parameters() if id(p) in head_ids}
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    if head is not None and shard_head and not ignored:
        _shard_head(head, mesh, mp)
    fully_shard(stack, mesh=mesh, mp_policy=mp, ignored_params=ignored or None)
    hooks = []
    for p in model.parameters():
        if p.requires_grad and not isinstance(p, DTensor):
            hooks.append(p.register_hook(_average_across_ranks))
    return hooks


def _shard_head(head: torch.nn.Module, mesh, mp) -> None:
    """The output head as its own FSDP2 unit, gathered around each loss call. Resharded after
    each call (it is not needed again until the loss's backward), hence its own root: the loss
    calls it outside the decoder stack's forward."""
    import types

    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from maximus.forward import HEAD_FORWARD_METHOD

    fully_shard(head, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    setattr(head, HEAD_FORWARD_METHOD, types.MethodType(_run_on_gathered_head, head))
    register_fsdp_forward_method(head, HEAD_FORWARD_METHOD)


def _run_on_gathered_head(head: torch.nn.Module, hidden: torch.Tensor, compute):
    """`compute(hidden)`; FSDP2's hooks around it gather the head's weight first and register the
    backward all-gather and reduce-scatter on `hidden` and the result."""
    return compute(hidden)


def _average_across_ranks(grad: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of one backward's gradient (before it is accumulated into .grad, so
    gradient accumulation adds averaged micro-batch gradients, as DDP does)."""
    out = grad.clone()
    dist.all_reduce(out)
    return out.div_(dist.get_world_size())


def _full(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()  # an all-gather: every rank runs it, in the same order
    return t.detach().cpu() if keep else None


def full_trainable_state(model: torch.nn.Module, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """Whole trainable tensors by parameter name, on the CPU (gathered from FSDP2 shards one at a
    time, so only one whole tensor is on the device at once). Ranks with keep=False take part in
    the gathers and get {}."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            t = _full(p, keep)
            if keep:
                out[name] = t
    return out


def full_optimizer_state(optimizer: torch.optim.Optimizer, *, keep: bool = True) -> dict:
    """`optimizer.state_dict()` with whole tensors: exactly what one process would save, so the
    checkpoint resumes under any number of processes."""
    sd = optimizer.state_dict()
    state = {}
    for idx in sorted(sd["state"]):
        state[idx] = {k: (_full(v, keep) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                      for k, v in sd["state"][idx].items()}
    return {"state": state, "param_groups": sd["param_groups"]} if keep else {}


def _shard_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Optimizer load pre-hook: whole saved tensors of sharded parameters become DTensors with the
    parameter's sharding (each rank keeps its slice; no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_id = dict(zip(saved_ids, params))
    state = {}
    for idx, st in state_dict["state"].items():
        p = by_id.get(int(idx))
        new = {}
        for k, v in st.items():
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == p.shape:
                v = distribute_tensor(v.to(p.to_local().device), p.device_mesh, p.placements, src_data_rank=None)
            new[k] = v
        state[idx] = new
    return {**state_dict, "state": state}


class GatheredState:
    """Whole tensors gathered for a checkpoint, shaped like what `save_checkpoint` reads from a
    model (`named_parameters`, all trainable) and an optimizer (`state_dict`)."""

    def __init__(self, params: dict[str, torch.Tensor], optimizer_state: dict | None):
        self.tensors = params
        self.optimizer_state = optimizer_state

    def named_parameters(self):
        for name, t in self.tensors.items():
            yield name, torch.nn.Parameter(t, requires_grad=True)

    def state_dict(self) -> dict:
        return self.optimizer_state
