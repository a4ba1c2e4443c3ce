"""`grpo.generation: vllm`: GRPO's sampling by a vLLM engine colocated on the training GPU.

The engine loads the base model once (`gpu_memory_utilization` of the card's memory for its
weights and paged KV cache, see `VLLM_MEMORY_FRACTION`); the policy reaches it as a LoRA
adapter: before each generation the trainer's adapter (the deltas only, a few MiB) is saved to
`output_dir/vllm_adapter/<version>` (atomically, PEFT's own format) and sampled through a new
`LoRARequest`, so the engine never holds a second copy of the base. The versions count on across
a resume (`AdapterVersions`). Sampling parameters are the
batched sampler's (`maximus.train.sampling`): `group_size` completions per prompt (`n`),
temperature, top-p, `max_completion_tokens`, stop at EOS (kept), seeded by (seed, generation).

Requires CUDA, the `vllm` package and an adapter (method lora / qlora); the config check
(`maximus.memory.generation.check_sampler`) says so in one line before any model is loaded.
The log-probs of the loss are still the trainer's own (vLLM's kernels differ in the last bits;
TRL does the same), so the on-policy identity holds for the kept log-probs, not vLLM's.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from maximus.train.sampling import Sampled

#: Share of the GPU's memory the engine may take (weights + KV cache); the rest is training's.
VLLM_MEMORY_FRACTION = 0.3


class AdapterVersions:
    """The adapter copies the engine samples with: ``output_dir/vllm_adapter/<n>``, written
    atomically, the one before the last removed (the engine may still read the last). `version`
    counts on from the highest copy a run left, so a resumed run's first save is a new version and
    never lands on a surviving one (each copy is one LoRA id to the engine)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.version = max((int(p.name) for p in self.root.glob("*") if p.is_dir() and p.name.isdigit()), default=0)

    def save(self, model) -> Path:
        """Write the adapter (`model.save_pretrained`, the LoRA deltas) as the next version; its path."""
        self.version += 1
        target = self.root / str(self.version)
        tmp = target.with_name(f".{self.version}.tmp")  # our own name inside our run directory
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp))
        tmp.replace(target)
        shutil.rmtree(self.root / str(self.version - 2), ignore_errors=True)  # a copy this run wrote
        return target


class VllmSampler:
    """One vLLM engine for the run; `sample` syncs the adapter, then draws every group at once."""

    def __init__(self, cfg, plan_dtype: str):
        from vllm import LLM

        self.cfg = cfg
        self.adapters = AdapterVersions(Path(cfg.output_dir) / "vllm_adapter")
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(str(plan_dtype), "auto")
        self.llm = LLM(model=cfg.model, tokenizer=cfg.model, dtype=dtype, enable_lora=True,
                       max_lora_rank=max(8, cfg.lora.r), gpu_memory_utilization=VLLM_MEMORY_FRACTION,
                       seed=cfg.training.seed, max_model_len=cfg.training.seq_len + cfg.grpo.max_completion_tokens,
                       enable_prefix_caching=True)

    @property
    def version(self) -> int:
        """The adapter version the engine samples with now (0 before the first sync)."""
        return self.adapters.version

    def sync(self, model) -> object:
        """Save the current adapter (the LoRA deltas) and return the request that samples with it."""
        from vllm.lora.request import LoRARequest

        target = self.adapters.save(model)
        return LoRARequest(f"policy-{self.version}", self.version, str(target))

    def sample(self, model, prompt_ids: list[list[int]], *, seed: int, eos_token_id: int) -> Sampled:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        g = self.cfg.grpo
        started = time.perf_counter()
        request = self.sync(model)
        params = SamplingParams(n=g.group_size, temperature=g.temperature, top_p=g.top_p, top_k=-1,
                                max_tokens=g.max_completion_tokens, seed=seed, stop_token_ids=[eos_token_id])
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params,
                                    lora_request=request, use_tqdm=False)
        completions = []
        for out in outputs:
            group = []
            for o in out.outputs:
                ids = list(o.token_ids)
                if o.finish_reason == "stop" and (not ids or ids[-1] != eos_token_id):
                    ids.append(eos_token_id)  # the EOS that ended it carries loss, as with the batched sampler
                group.append(ids)
            completions.append(group)
        return Sampled(completions=completions, decode_s=time.perf_counter() - started, forwards=1)
