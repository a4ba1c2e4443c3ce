"""A vision-language model learns to name the colour of a picture, end to end with maximus-train.

    python examples/vision_colors.py [--family llava] [--steps 120] [--out runs/vision_colors]

Builds a tiny random vision-language model with its real processor (the test builders of
tests/tiny_vlm.py: LLaVA, Idefics3, Gemma 3, Qwen2-VL or Qwen2.5-VL), draws one-colour pictures
with PIL (six colours, each row its own shade and size, so no held-out picture was seen in
training), writes chat rows asking "What color is the picture?" and a run config: LoRA (the
default method) on the language model, the projector trained in full (`lora.projector`, LLaVA's
recipe) and the output head too (`lora.modules_to_save: [lm_head]`: a random tiny model's head
is too small for LoRA alone to make confident answers; `--frozen-head` leaves it frozen), the
tower frozen, fp32; then runs `maximus-train --config`. The answer can be
learned from the image alone. It prints the before/after table: held-out loss, exact match over
`--held-out` examples (chance: 1/6), and the generation for a red picture. docs/vision.md quotes
its figures.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_vlm import QUESTION, VLM_BUILDERS, draw_image, vlm_config, write_color_chat  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llava", choices=sorted(VLM_BUILDERS))
    parser.add_argument("--method", default="lora", choices=["lora", "full"])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rows", type=int, default=352, help="chat rows written, the held-out ones included")
    parser.add_argument("--held-out", type=int, default=96, help="rows held out and scored by exact match")
    parser.add_argument("--frozen-head", action="store_true", help="leave the output head frozen (not in lora.modules_to_save)")
    parser.add_argument("--out", default="runs/vision_colors")
    args = parser.parse_args()
    out = Path(args.out)
    model_dir = out / "model"
    if not (model_dir / "config.json").is_file():
        VLM_BUILDERS[args.family](model_dir)
    data = write_color_chat(out / "data", n=args.rows, shades=True)
    red = draw_image(out / "data" / "images" / "red.png", "red")
    head = {} if args.frozen_head else {"modules_to_save": ["lm_head"]}
    lora = {"r": 8, "alpha": 16, "projector": True, **head} if args.method == "lora" else {}
    cfg = vlm_config(model_dir, data, out / "run", method=args.method, lora=lora,
                     training={"max_steps": args.steps, "micro_batch_size": 8, "batch_size": 8, "learning_rate": args.lr},
                     eval={"split": args.held_out / args.rows, "exact_match": args.held_out, "max_new_tokens": 4,
                           "prompts": [{"text": QUESTION, "image": str(red)}]},
                     logging={"progress": "auto"})
    config = out / "run.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    from maximus.cli import train_main

    return train_main(["--config", str(config)])


if __name__ == "__main__":
    sys.exit(main())
