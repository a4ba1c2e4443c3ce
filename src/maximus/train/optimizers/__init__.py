"""The optimizer of a run, from `training.optimizer`: each low-memory choice comes from its own
package, and every one can save and resume its whole state (`state_dict` holds tensors and plain
values only, so the checkpoint writes it to safetensors + JSON).

| name | package | applies to |
|---|---|---|
| adamw, adamw_8bit, paged_adamw_8bit | torch, bitsandbytes | full, LoRA, QLoRA |
| adamw_4bit | torchao `AdamW4bit` | full, LoRA, QLoRA |
| adamw_8bit_torchao | torchao `AdamW8bit` (steps row block by row block inside the backward) | full, LoRA, QLoRA |
| apollo, apollo_mini | apollo-torch `APOLLOAdamW` (random projection) | full only |
| galore | galore-torch `GaLoreAdamW` (SVD projection) | full only |
| adam_mini | adam-mini `Adam_mini` | full, LoRA, QLoRA |
| muon | `torch.optim.Muon` on 2-D decoder weights + `torch.optim.AdamW` on the rest | full, LoRA, QLoRA |

APOLLO and GaLore project the gradient of each 2-D decoder weight onto `rank` directions; an
adapter is already a rank-r matrix, so projecting it saves nothing and they are full-only.

`training.master_weights: bf16` keeps the weights in bf16 and rounds each update stochastically
(torchao's `_AdamW` / `AdamW4bit` with ``bf16_stochastic_round``) instead of keeping float32
master weights.

`training.embedding_optimizer: adamw_4bit` gives the embedding and the head of apollo /
apollo_mini / galore / muon torchao's 4-bit AdamW (a part of a `CompositeOptimizer`) instead of
the float32 AdamW moments their recipes keep there.

torchao's step runs on row chunks of at most `TORCHAO_CHUNK_VALUES` values, whole 4-bit blocks
each: its float32 copies are those of one chunk (the same elementwise update, block by block).

`training.optimizer_in_backward: true` builds one optimizer per parameter and steps it from the
parameter's post-accumulate-grad hook, then frees the gradient (`InBackwardOptimizer`): the whole
set of gradients never exists at once. What that excludes is refused by `check_in_backward`.
With `training.max_grad_norm` set, each step's backward runs twice: the first only sums the
squared gradients (`measuring`), the second steps every weight on its gradient times the clip
coefficient that norm gives (`clip_to`): exactly `clip_grad_norm_` followed by the step.

Raises `ConfigError` (one line): a package that is not installed (with the pip command, checked by
`require_packages` before the model loads), a rank larger than a weight's smaller side (naming
the weight), an optimizer that does not apply to the method, in-backward combinations that would
be wrong.
"""
from __future__ import annotations

from maximus.train.optimizers.checks import check_in_backward, require_packages
from maximus.train.optimizers.composite import CompositeOptimizer
from maximus.train.optimizers.factories import build_optimizer
from maximus.train.optimizers.in_backward import InBackwardOptimizer

__all__ = ["build_optimizer", "require_packages", "check_in_backward", "CompositeOptimizer", "InBackwardOptimizer"]
