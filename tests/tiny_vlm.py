"""Tiny random vision-language models with their processors, and image datasets drawn with PIL.
Import as `from tiny_vlm import ...` (tests/ is on sys.path; benchmarks add it themselves).

One builder per Transformers class (`VLM_BUILDERS`: LLaVA, Idefics3, Gemma 3, Qwen2-VL,
Qwen2.5-VL), each with its real processor class built offline: the test tokenizer with the
family's image tokens, the family's PIL image processor at a tiny resolution, and a chat
template that writes image parts as the family's own template does. Saved with save_pretrained.

The task (`write_color_chat`): each image is one colour; the user asks for it and the assistant
answers its name. It can be learned from the image alone: the question is always the same."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tiny import merge_sections, save_random_model

COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30),
          "black": (10, 10, 10), "white": (245, 245, 245)}
QUESTION = "What color is the picture?"


def chatml_template(image: str) -> str:
    """A ChatML template that writes an image part as `image` (the family's placeholder text)."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + image + "{% else %}{{ p['text'] }}"
            "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


#: LLaVA's processor token.
CHAT_TEMPLATE = chatml_template("<image>")

#: Gemma 3's turn format (`model` for the assistant), an image part as `<start_of_image>`.
GEMMA3_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
                   "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
                   "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
                   "{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

#: Idefics3 / SmolVLM's `User:` / `Assistant:` turns ending in `<end_of_utterance>`.
IDEFICS3_TEMPLATE = ("<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}"
                     "{% if m['content'] is string %}: {{ m['content'] }}{% else %}{% if m['content'][0]['type'] == 'image' %}:"
                     "{% else %}: {% endif %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}"
                     "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
                     "{% if add_generation_prompt %}Assistant:{% endif %}")

#: Image tokens each family's tokenizer carries (beyond ChatML's).
FAMILY_TOKENS = {
    "llava": ["<image>"],
    "idefics3": ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                 *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]],
    "gemma3": ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"],
    "qwen2_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
}


def tiny_vlm_tokenizer(family: str = "llava", template: str = CHAT_TEMPLATE):
    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    texts = [QUESTION, *COLORS, "user assistant system User Assistant model"] * 8
    tok = build_tiny_tokenizer(texts, vocab_size=300)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *FAMILY_TOKENS[family]]})
    if family == "gemma3":  # Gemma3Processor reads these named tokens off its tokenizer (as Gemma 3's own has them)
        tok = type(tok)(tokenizer_object=tok.backend_tokenizer, eos_token=tok.eos_token, pad_token=tok.pad_token,
                        extra_special_tokens=tok.extra_special_tokens, boi_token="<start_of_image>",
                        image_token="<image_soft_token>", eoi_token="<end_of_image>")
        tok.model_max_length = 1_000_000
    tok.chat_template = template
    return tok


def _text_fields(tok, hidden: int, layers: int, **extra) -> dict:
    end = "<end_of_turn>" if "<end_of_turn>" in tok.get_vocab() else "<|im_end|>"
    return dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                eos_token_id=tok.convert_tokens_to_ids(end), pad_token_id=tok.pad_token_id, bos_token_id=None, **extra)


def build_tiny_llava(path: Path, *, image_size: int = 32, patch: int = 8, hidden: int = 64, vision_hidden: int = 32,
                     layers: int = 2, seed: int = 0) -> Path:
    """LLaVA (CLIP tower, 2-layer MLP projector, Llama) with a CLIP image processor resizing to
    `image_size` (so (image_size / patch)^2 image tokens per image)."""
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = tiny_vlm_tokenizer()
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                            crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=patch,
                               vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                               num_additional_image_tokens=1)
    vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=vision_hidden * 2, num_hidden_layers=layers,
                              num_attention_heads=2, image_size=image_size, patch_size=patch,
                              projection_dim=vision_hidden)
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_text_fields(tok, hidden, layers)),
                         image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
                         vision_feature_layer=-1, image_seq_length=(image_size // patch) ** 2)
    return save_random_model(path, LlavaForConditionalGeneration, config, processor, seed=seed)


def build_tiny_idefics3(path: Path, *, image_size: int = 32, patch: int = 8, hidden: int = 64, vision_hidden: int = 32,
                        layers: int = 2, seed: int = 0) -> Path:
    """Idefics3 / SmolVLM (SigLIP-style tower, pixel-shuffle connector with scale 2, Llama): one
    `image_size` tile per image (no splitting), (image_size / patch / 2)^2 image tokens."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor, Idefics3VisionConfig, LlamaConfig)

    tok = tiny_vlm_tokenizer("idefics3", IDEFICS3_TEMPLATE)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": image_size}, do_image_splitting=False,
                                                max_image_size={"longest_edge": image_size})
    seq = (image_size // patch // 2) ** 2
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=seq,
                                  chat_template=IDEFICS3_TEMPLATE)
    vision = Idefics3VisionConfig(hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
                                  num_hidden_layers=layers, num_attention_heads=2, image_size=image_size,
                                  patch_size=patch)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=LlamaConfig(**_text_fields(tok, hidden, layers)).to_dict(),
                            image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)
    return save_random_model(path, Idefics3ForConditionalGeneration, config, processor, seed=seed)


def build_tiny_gemma3(path: Path, *, image_size: int = 32, patch: int = 8, hidden: int = 64, vision_hidden: int = 32,
                      layers: int = 2, seed: int = 0) -> Path:
    """Gemma 3 (SigLIP tower, average-pool projector to 4 tokens per image, Gemma 3 text model
    with a sliding-window layer)."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,
                              Gemma3Processor, Gemma3TextConfig, SiglipVisionConfig)

    tok = tiny_vlm_tokenizer("gemma3", GEMMA3_TEMPLATE)
    tokens = 4
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=tokens,
                                chat_template=GEMMA3_TEMPLATE)
    vision = SiglipVisionConfig(hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
                                num_hidden_layers=layers, num_attention_heads=2, image_size=image_size,
                                patch_size=patch, vision_use_head=False)
    text = Gemma3TextConfig(**_text_fields(tok, hidden, layers, head_dim=16, query_pre_attn_scalar=16,
                                           sliding_window=16, layer_types=["sliding_attention", "full_attention"]))
    config = Gemma3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), mm_tokens_per_image=tokens,
                          boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
                          eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
                          image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"))
    return save_random_model(path, Gemma3ForConditionalGeneration, config, processor, seed=seed)


def build_tiny_qwen2_vl(path: Path, *, version: str = "qwen2_vl", patch: int = 8, hidden: int = 64,
                        vision_hidden: int = 32, layers: int = 2, seed: int = 0, max_pixels: int = 32 * 32) -> Path:
    """Qwen2-VL (or `version="qwen2_5_vl"`: Qwen2.5-VL): ViT with 2-D rotary patches, 2x2 patch
    merger, Qwen2 text model with multimodal (3-D) rotary positions. The processor is built from
    its image processor and tokenizer without a video processor (which needs torchvision); images
    keep their resolution up to `max_pixels` (a 32 x 32 image: 4 image tokens)."""
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    tok = tiny_vlm_tokenizer("qwen2_vl", chatml_template("<|vision_start|><|image_pad|><|vision_end|>"))
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                               min_pixels=(patch * 2) ** 2, max_pixels=max_pixels)
    from maximus.vision import image_only_processor

    names = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[version]
    processor = image_only_processor(getattr(transformers, f"{names}Processor"))(
        image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
    vision_fields = dict(depth=layers, embed_dim=vision_hidden, hidden_size=hidden, num_heads=2, patch_size=patch,
                         spatial_merge_size=2, temporal_patch_size=2)
    if version == "qwen2_5_vl":
        vision_fields.update(hidden_size=vision_hidden, out_hidden_size=hidden, intermediate_size=vision_hidden * 2,
                             window_size=patch * 4, fullatt_block_indexes=[layers - 1])
    else:
        vision_fields["mlp_ratio"] = 2
    text = _text_fields(tok, hidden, layers, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                              "rope_theta": 10000.0})
    config_cls = getattr(transformers, f"{names}Config")
    config = config_cls(vision_config=vision_fields, text_config=text,
                        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
                        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
                        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    return save_random_model(path, getattr(transformers, f"{names}ForConditionalGeneration"), config, processor,
                             seed=seed)


#: model_type -> builder(path, seed=...) of a tiny random VLM with its processor.
VLM_BUILDERS = {"llava": build_tiny_llava, "idefics3": build_tiny_idefics3, "gemma3": build_tiny_gemma3,
                "qwen2_vl": build_tiny_qwen2_vl,
                "qwen2_5_vl": lambda path, **kw: build_tiny_qwen2_vl(path, version="qwen2_5_vl", **kw)}


def draw_image(path: Path, color: str, size: tuple[int, int] = (40, 32)) -> Path:
    from PIL import Image

    Image.new("RGB", size, COLORS[color]).save(path)
    return path


def draw_shade(path: Path, color: str, rng: random.Random, size: tuple[int, int] = (40, 32), jitter: int = 40) -> Path:
    """A picture of `color` in its own shade (each channel moved by up to `jitter`) and its own
    size (each side 0.75-1.25x `size`), so that no two rows show the same image."""
    from PIL import Image

    rgb = tuple(min(255, max(0, v + rng.randint(-jitter, jitter))) for v in COLORS[color])
    Image.new("RGB", tuple(int(s * rng.uniform(0.75, 1.25)) for s in size), rgb).save(path)
    return path


def write_color_chat(folder: Path, n: int = 48, *, seed: int = 0, size: tuple[int, int] = (40, 32),
                     style: str = "parts", colors: list[str] | None = None, shades: bool = False) -> Path:
    """`n` chat rows asking for the colour of an image drawn into folder/images/ (paths relative
    to the data file). `style`: `parts` (content lists with image parts) or `column` (an images
    column and an `<image>` placeholder). `colors`: the colours drawn (default: all six).
    `shades`: each row its own picture (`draw_shade`) instead of one picture per colour."""
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = list(colors or COLORS)
    drawn = {c: draw_image(folder / "images" / f"{c}.png", c, size) for c in names}
    data = folder / "data.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for i in range(n):
            color = rng.choice(names)
            picture = draw_shade(folder / "images" / f"{i}-{color}.png", color, rng, size) if shades else drawn[color]
            image = str(picture.relative_to(folder))
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
    return merge_sections(cfg, sections)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """A tiny LLaVA with its processor, built once per test module."""
    return build_tiny_llava(tmp_path_factory.mktemp("vlm") / "llava")
