"""Two optimizer steps of each config in a JSON list, keeping each step's loss and gradients
(after DDP's average). Run by torchrun (`training.context_parallel` = the world size) and, for
the one-process oracle, imported and called directly. Rank 0 writes OUT/<name>.safetensors."""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from maximus import Config, Trainer

STEPS = 2


def two_steps(cfg: dict) -> tuple[dict[str, torch.Tensor], Trainer]:
    """{"loss": [step losses], "<step>/<parameter>": gradient} of the first STEPS steps of `cfg`."""
    kept: dict[str, torch.Tensor] = {}

    def keep_grads(trainer, step):  # the gradient itself, before AdamW turns it into ~sign(grad)
        for name, p in trainer.model.named_parameters():
            if p.requires_grad:
                kept[f"{step}/{name}"] = p.grad.detach().clone()

    trainer = Trainer(Config.from_dict(cfg), hooks={"after_backward": keep_grads})
    trainer.setup()
    losses = [trainer.train_step(step)["loss"] for step in range(1, STEPS + 1)]
    kept["loss"] = torch.tensor(losses, dtype=torch.float64)
    return kept, trainer


def main(configs: Path, out: Path) -> None:
    trainer = None
    for name, cfg in json.loads(configs.read_text()).items():
        kept, trainer = two_steps(cfg)
        if trainer.dist.is_main:
            save_file(kept, str(out / f"{name}.safetensors"))
            print(f"{name}: exchange {trainer.context.exchange}", flush=True)
    trainer.dist.shutdown(clean=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
