"""A vision-language model learns to name the colour of a picture, end to end with maximus-train.

    python examples/vision_colors.py [--family llava] [--steps 40] [--out runs/vision_colors]

Builds a tiny random vision-language model with its real processor (the test builders of
tests/tiny_vlm.py: LLaVA, Idefics3, Gemma 3, Qwen2-VL or Qwen2.5-VL), draws one-colour images
with PIL, writes chat rows asking "What color is the picture?" and a run config (full
fine-tuning of the language model, fp32; tower and projector frozen), then runs
`maximus-train --config`. The answer can be learned from the image alone. It prints the
before/after table: held-out loss, exact match, and the generation for an image prompt.
docs/vision.md quotes its figures.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_vlm import QUESTION, VLM_BUILDERS, vlm_config, write_color_chat  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llava", choices=sorted(VLM_BUILDERS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="runs/vision_colors")
    args = parser.parse_args()
    out = Path(args.out)
    model_dir = out / "model"
    if not (model_dir / "config.json").is_file():
        VLM_BUILDERS[args.family](model_dir)
    data = write_color_chat(out / "data", n=64)
    cfg = vlm_config(model_dir, data, out / "run", method="full",
                     training={"max_steps": args.steps, "micro_batch_size": 8, "batch_size": 8, "learning_rate": args.lr},
                     eval={"split": 0.25, "exact_match": 16, "max_new_tokens": 4,
                           "prompts": [{"text": QUESTION, "image": str(out / "data" / "images" / "red.png")}]},
                     logging={"progress": "auto"})
    config = out / "run.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    from maximus.cli import train_main

    return train_main(["--config", str(config)])


if __name__ == "__main__":
    sys.exit(main())
