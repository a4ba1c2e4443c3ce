"""Vision-language fine-tuning on a tiny random LLaVA (CLIP tower + Llama) with its processor,
on images drawn with PIL: data formats, the loss mask, errors, adapters and the exact loss."""
from __future__ import annotations

import json

import pytest
import torch

from tiny import one_thread  # noqa: F401  (a fixture, used through pytestmark)
from tiny_vlm import llava  # noqa: F401  (a fixture)
from tiny_vlm import COLORS, draw_image, vlm_config, write_color_chat

from maximus.config import Config
from maximus.errors import DataError, ModelError

pytestmark = pytest.mark.usefixtures("one_thread")


def _splits(model, data, out, **sections):
    from maximus.data import build_run_datasets

    cfg = Config.model_validate(vlm_config(model, data, out, **sections))
    return build_run_datasets(cfg, None)


def test_loss_mask_is_the_assistant_tokens_exactly(llava, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llava)
    image_id = tok.convert_tokens_to_ids("<image>")
    parts = _splits(llava, write_color_chat(tmp_path / "a", n=12), tmp_path / "o", eval={"split": 0.0})
    column = _splits(llava, write_color_chat(tmp_path / "b", n=12, style="column"), tmp_path / "o", eval={"split": 0.0})
    assert [r["input_ids"] for r in parts.train] == [r["input_ids"] for r in column.train]
    for row in parts.train:
        ids, labels = row["input_ids"], row["labels"]
        assert ids.count(image_id) == 16  # (32 / 8)^2 patches, from the processor
        trained = [t for t in labels if t != -100]
        answer = tok.decode(trained)
        assert answer.removesuffix("<|im_end|>\n") in COLORS
        assert trained == tok(answer, add_special_tokens=False)["input_ids"]
        # exactly the tail: everything before (prompt, image tokens, markers) is masked
        assert labels == [-100] * (len(ids) - len(trained)) + trained
        assert ids[-len(trained):] == trained
    assert parts.stats["vision"]["images"] == 12 and parts.stats["packing"] is False


def test_missing_image_is_one_line_or_skipped(llava, tmp_path):
    data = write_color_chat(tmp_path, n=6)
    lines = data.read_text().splitlines()
    row = json.loads(lines[2])
    row["messages"][0]["content"][0]["image"] = "images/nope.png"
    lines[2] = json.dumps(row)
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        _splits(llava, data, tmp_path / "o")
    assert err.value.message == f"{data}:3: cannot read image {tmp_path / 'images/nope.png'}: no such file"
    skipped = _splits(llava, data, tmp_path / "o", dataset={"path": str(data), "on_error": "skip"})
    assert skipped.stats["skipped"] == 1 and skipped.stats["documents"] == 5


def test_images_outside_vision_image_root_are_refused_before_they_open(llava, tmp_path):
    root = tmp_path / "data"
    data = write_color_chat(root, n=6)
    outside = draw_image(tmp_path / "outside.png", "red")
    (root / "images" / "link.png").symlink_to(outside)
    lines = data.read_text().splitlines()
    for i, image in ((1, str(outside)), (3, "images/link.png")):
        row = json.loads(lines[i])
        row["messages"][0]["content"][0]["image"] = image
        lines[i] = json.dumps(row)
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        _splits(llava, data, tmp_path / "o", vision={"image_root": str(root)})
    assert err.value.one_line() == (f"{data}:2: image {outside} is outside vision.image_root {root} "
                                    "(hint: put the images under that folder, or change vision.image_root)")
    skipped = _splits(llava, data, tmp_path / "o", vision={"image_root": str(root)},
                      dataset={"path": str(data), "on_error": "skip"})
    assert skipped.stats["skipped"] == 2 and skipped.stats["documents"] == 4  # the link out too
    assert _splits(llava, data, tmp_path / "o").stats["documents"] == 6  # null: anywhere


def test_text_format_names_the_format_it_needs(llava, tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(DataError, match=r"format text cannot carry images, and .* is a vision-language model: it "
                                        r"needs format: chat"):
        _splits(llava, data, tmp_path / "o")


def test_large_image_is_resized_to_max_pixels(llava, tmp_path):
    data = write_color_chat(tmp_path, n=4, size=(80, 64))
    splits = _splits(llava, data, tmp_path / "o", vision={"max_pixels": 1024})
    assert splits.stats["vision"]["resized"] == 4
    from maximus.data.vision import open_image

    image, resized = open_image(tmp_path / "images" / "red.png", 1024)
    assert resized and image.size == (35, 28) and image.size[0] * image.size[1] <= 1024


def test_model_without_processor_is_one_line(llava, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in llava.iterdir():
        if f.name.endswith((".safetensors", "config.json")) and "processor" not in f.name and "preprocessor" not in f.name:
            shutil.copy(f, bare / f.name)
    from maximus.vision import load_processor

    with pytest.raises(ModelError) as err:
        load_processor(str(bare))
    assert err.value.message.startswith(f"cannot load the image processor of {bare}")


def _train(llava, tmp_path, **sections):
    from maximus.train.trainer import Trainer

    data = write_color_chat(tmp_path / "data", n=40)
    trainer = Trainer(Config.model_validate(vlm_config(llava, data, tmp_path / "out", **sections)))
    summary = trainer.train()
    return trainer, summary


def test_lora_on_the_language_model_only_and_the_adapter_loads_in_peft(llava, tmp_path):
    from peft import PeftModel
    from transformers import LlavaForConditionalGeneration

    from maximus.data import collate
    from maximus.forward import sft_loss_sum

    trainer, summary = _train(llava, tmp_path, training={"max_steps": 3})
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("language_model" in n and "lora_" in n for n in trainable)
    base = LlavaForConditionalGeneration.from_pretrained(llava)
    tower = {n: p for n, p in base.named_parameters() if "language_model" not in n}
    tuned = dict(trainer.model.get_base_model().named_parameters())
    assert all(torch.equal(p, tuned[n]) for n, p in tower.items())  # tower and projector untouched
    batch = collate(trainer.data.eval[:4], trainer.tokenizer.pad_token_id)
    trainer.model.eval()
    with torch.no_grad():
        ours, n = sft_loss_sum(trainer.model, batch)
        assert float(ours / n) == pytest.approx(float(trainer.model(**batch).loss), abs=1e-6)  # exact chunked loss
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        loaded = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").eval()
        assert torch.equal(loaded(**inputs).logits, trainer.model(**inputs).logits)
    assert summary["eval"]["after"]["loss"] < summary["eval"]["before"]["loss"]
    assert (tmp_path / "out" / "adapter" / "processor_config.json").is_file()
    from maximus.export.merged import export_merged

    merged = LlavaForConditionalGeneration.from_pretrained(export_merged(tmp_path / "out", tmp_path / "merged")).eval()
    assert (tmp_path / "merged" / "processor_config.json").is_file()
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, trainer.model(**inputs).logits, atol=1e-5, rtol=1e-5)


def test_lora_vision_and_projector_switches(llava, tmp_path):
    trainer, _ = _train(llava, tmp_path, lora={"r": 4, "alpha": 8, "vision": True, "projector": True},
                        training={"max_steps": 1}, eval={"enabled": False})
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("vision_tower" in n and "lora_" in n for n in trainable)
    assert any("multi_modal_projector.modules_to_save" in n for n in trainable)
    assert not any("multi_modal_projector" in n and "lora_" in n for n in trainable)


def test_gguf_export_of_a_vlm_is_refused_in_one_line(llava):
    from transformers import AutoConfig

    from maximus.errors import ExportError
    from maximus.export.to_gguf import check_architecture

    with pytest.raises(ExportError) as err:
        check_architecture(AutoConfig.from_pretrained(llava))
    assert err.value.message == ("model type 'llava' is a vision-language model: its GGUF needs llama.cpp's separate "
                                 "mmproj file for the vision tower, which the gguf package does not write")
