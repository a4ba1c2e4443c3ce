"""Evaluation on images: held-out exact match of greedy answers to image rows, generations for
`eval.prompts` that name an image (equal to Transformers' own generate on the processor's
inputs), and the one-line refusals around them."""
from __future__ import annotations

import pytest
import torch

from tiny import one_thread  # noqa: F401  (a fixture, used through pytestmark)
from tiny_vlm import llava  # noqa: F401  (a fixture)
from tiny_vlm import QUESTION, draw_image, vlm_config, write_color_chat

from maximus.config import Config, ImagePrompt
from maximus.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

#: The short learnable run (examples/vision_colors.py runs the full one: 120 steps, 96 held out): LoRA
#: (the default method) with the projector and the head trained, three colours, every picture its own
#: shade and size.
LEARN = {"rows": 132, "held_out": 36, "steps": 20, "lr": 1e-2, "colors": ["red", "green", "blue"]}
#: Exact match the run must reach on the held-out pictures. Chance is 1/3 (a constant answer scores
#: about that); 27 or more of 36 right by chance has probability below 1e-6.
LEARNED = 0.75


def test_image_prompts_are_refused_where_they_cannot_apply(tmp_path):
    from maximus.evaluate import generate_text

    prompt = {"text": QUESTION, "image": "images/red.png"}
    with pytest.raises(ConfigError) as err:
        Config.model_validate({"model": "m", "dataset": "d.jsonl", "objective": "dpo", "eval": {"prompts": [prompt]}})
    assert err.value.message == "eval.prompts: an image prompt does not apply to objective dpo"
    with pytest.raises(ConfigError) as err:
        generate_text(None, None, ["a text prompt", ImagePrompt(**prompt)], device=torch.device("cpu"))
    assert err.value.message == "eval.prompts: an image prompt needs a vision-language model"
    assert str(ImagePrompt(text="Which?", image=["a.png", "b.png"])) == "[a.png, b.png] Which?"


def test_missing_prompt_image_and_few_shot_on_images_are_one_line(llava, tmp_path):
    from maximus.data import build_run_datasets
    from maximus.evaluate.tasks import TaskEval

    data = write_color_chat(tmp_path, n=8)
    cfg = Config.model_validate(vlm_config(llava, data, tmp_path / "out", eval={"split": 0.25, "few_shot": 2}))
    splits = build_run_datasets(cfg, None)
    encoder = splits.eval[0]["images"].encoder
    missing = tmp_path / "images" / "nope.png"
    with pytest.raises(ConfigError) as err:
        encoder.prompt_for(ImagePrompt(text=QUESTION, image=str(missing)))
    assert err.value.message == f"eval.prompts: cannot read image {missing}: no such file"
    with pytest.raises(ConfigError) as err:
        TaskEval(cfg, encoder.tokenizer, splits)
    assert err.value.message == "eval.few_shot / eval.system_prompt: the prompting baseline does not show images yet"
    held = write_color_chat(tmp_path / "held", n=3, seed=1)
    cfg = Config.model_validate(vlm_config(llava, data, tmp_path / "out", eval={"dataset": str(held)}))
    splits = build_run_datasets(cfg, None)
    assert len(splits.train) == 8 and len(splits.eval) == 3 and splits.stats["eval_documents"] == 3
    assert sorted(splits.eval_where) == [f"{held}:{i}" for i in (1, 2, 3)]
    assert {w.rsplit(":", 1)[0] for w in splits.train_where} == {str(data)}


def test_colour_task_is_learned_from_the_image_and_image_prompts_generate_as_transformers(llava, tmp_path):
    """The short version of the learnable task (examples/vision_colors.py runs the full one): LoRA on
    the tiny LLaVA's language model with its projector and output head trained (`lora.projector`,
    `lora.modules_to_save`), the tower frozen, on one-colour pictures of three colours, each row its
    own shade and size; the held-out loss falls by more than half and held-out exact match goes
    from 0 to far above chance. The image prompt's generation after
    training equals Transformers' generate on the processor's inputs for the same image."""
    from PIL import Image

    from maximus.train.trainer import Trainer
    from maximus.vision import load_processor

    data = write_color_chat(tmp_path, n=LEARN["rows"], colors=LEARN["colors"], shades=True)
    red = draw_image(tmp_path / "images" / "red.png", "red")
    lora = {"r": 8, "alpha": 16, "projector": True, "modules_to_save": ["lm_head"]}
    cfg = vlm_config(llava, data, tmp_path / "out", lora=lora,
                     training={"max_steps": LEARN["steps"], "micro_batch_size": 8, "batch_size": 8,
                               "learning_rate": LEARN["lr"]},
                     eval={"split": LEARN["held_out"] / LEARN["rows"], "exact_match": LEARN["held_out"],
                           "max_new_tokens": 4, "prompts": [{"text": QUESTION, "image": str(red)}]})
    trainer = Trainer(Config.model_validate(cfg))
    summary = trainer.train()
    before, after = summary["eval"]["before"], summary["eval"]["after"]
    assert after["loss"] < 0.5 * before["loss"]
    assert before["exact_match"] == 0 and after["scored"] == LEARN["held_out"]
    assert after["exact_match"] >= LEARNED, after["exact_match"]
    tower = [p for n, p in trainer.model.named_parameters() if "vision_tower" in n]
    projector = [n for n, p in trainer.model.named_parameters() if "multi_modal_projector" in n and p.requires_grad]
    assert tower and not any(p.requires_grad for p in tower)
    assert projector and all(".modules_to_save." in n for n in projector)  # PEFT's trained copy

    processor = load_processor(str(llava))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with Image.open(red) as im:
        inputs = processor(text=[text], images=[[im.convert("RGB")]], add_special_tokens=False, return_tensors="pt")
    model = trainer.model.eval()
    with torch.no_grad():
        stops = [processor.tokenizer.eos_token_id, model.generation_config.eos_token_id]
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=stops,
                             pad_token_id=processor.tokenizer.pad_token_id)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert after["generations"] == [expected]
