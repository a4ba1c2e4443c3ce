"""Tiny random vision-language models with their processors, and image datasets drawn with PIL.
Import as `from tiny_vlm import ...` (tests/ is on sys.path; benchmarks add it themselves).

The task (`write_color_chat`): each image is one colour; the user asks for it and the assistant
answers its name. It can be learned from the image alone: the question is always the same."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30),
          "black": (10, 10, 10), "white": (245, 245, 245)}
QUESTION = "What color is the picture?"

#: A ChatML template that writes an image part as `<image>` (the LLaVA processor's token).
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}"
                 "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_vlm_tokenizer():
    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    texts = [QUESTION, *COLORS, "user assistant system"] * 8
    tok = build_tiny_tokenizer(texts, vocab_size=300)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_llava(path: Path, *, image_size: int = 32, patch: int = 8, hidden: int = 64, vision_hidden: int = 32,
                     layers: int = 2, seed: int = 0) -> Path:
    """LLaVA (CLIP tower, 2-layer MLP projector, Llama) with a CLIP image processor resizing to
    `image_size` (so (image_size / patch)^2 image tokens per image), saved with save_pretrained."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = tiny_vlm_tokenizer()
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=patch,
                               vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                               num_additional_image_tokens=1)
    vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=vision_hidden * 2, num_hidden_layers=layers,
                              num_attention_heads=2, image_size=image_size, patch_size=patch,
                              projection_dim=vision_hidden)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
                       bos_token_id=None)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         image_seq_length=(image_size // patch) ** 2)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.save_pretrained(str(path), safe_serialization=True)
    processor.save_pretrained(str(path))
    return path


def draw_image(path: Path, color: str, size: tuple[int, int] = (40, 32)) -> Path:
    from PIL import Image

    Image.new("RGB", size, COLORS[color]).save(path)
    return path


def write_color_chat(folder: Path, n: int = 48, *, seed: int = 0, size: tuple[int, int] = (40, 32),
                     style: str = "parts") -> Path:
    """`n` chat rows asking for the colour of an image drawn into folder/images/ (paths relative
    to the data file). `style`: `parts` (content lists with image parts) or `column` (an images
    column and an `<image>` placeholder)."""
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = list(COLORS)
    drawn = {c: draw_image(folder / "images" / f"{c}.png", c, size) for c in names}
    data = folder / "data.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for _ in range(n):
            color = rng.choice(names)
            image = str(drawn[color].relative_to(folder))
            if style == "parts":
                row = {"messages": [
                    {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]},
                    {"role": "assistant", "content": [{"type": "text", "text": color}]}]}
            else:
                row = {"messages": [{"role": "user", "content": f"<image>{QUESTION}"},
                                    {"role": "assistant", "content": color}], "images": [image]}
            f.write(json.dumps(row) + "\n")
    return data


def vlm_config(model_dir: Path, data: Path, out: Path, **sections) -> dict:
    """A small run config for a tiny VLM (fp32, LoRA, no checkpointing)."""
    cfg = {
        "model": str(model_dir), "dataset": {"path": str(data)}, "method": "lora", "output_dir": str(out),
        "lora": {"r": 8, "alpha": 16},
        "optimization": {"gradient_checkpointing": "off"},
        "training": {"batch_size": 8, "micro_batch_size": 4, "max_steps": 4, "learning_rate": 5e-3,
                     "warmup_steps": 0, "seq_len": 64, "dtype": "fp32", "seed": 0},
        "eval": {"split": 0.2, "before": True},
        "logging": {"progress": "none"},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg
