"""Every supported vision-language class end to end: a tiny random Idefics3, Gemma 3, Qwen2-VL and
Qwen2.5-VL with their real processors (built offline), trained by `maximus-train --config` for 3
fp32 steps on images drawn with PIL. Per class: the loss mask is the assistant tokens exactly
(image tokens, vision markers and the prompt masked), the collated image tensors equal the
processor's own, the exact chunked loss equals Transformers', the tower and projector are frozen
and unchanged, and the adapter loads in PEFT with identical logits."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from tiny import one_thread  # noqa: F401  (a fixture, used through pytestmark)
from tiny_vlm import COLORS, VLM_BUILDERS, vlm_config, write_color_chat

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("idefics3", "gemma3", "qwen2_vl", "qwen2_5_vl")
END_OF_TURN = {"idefics3": "<end_of_utterance>\n", "gemma3": "<end_of_turn>\n", "qwen2_vl": "<|im_end|>\n",
               "qwen2_5_vl": "<|im_end|>\n"}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_through_the_cli_with_exact_mask_loss_and_adapter(family, tmp_path):
    from peft import PeftModel
    from PIL import Image
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from maximus.cli import train_main
    from maximus.config import Config
    from maximus.data import build_run_datasets, collate
    from maximus.evaluate import heldout_loss
    from maximus.forward import sft_loss_sum
    from maximus.vision import load_processor, vision_parts

    model_dir = VLM_BUILDERS[family](tmp_path / family)
    data = write_color_chat(tmp_path / "data", n=16)
    cfg = vlm_config(model_dir, data, tmp_path / "out", training={"max_steps": 3, "micro_batch_size": 2,
                                                                 "batch_size": 4, "seq_len": 96},
                     eval={"split": 0.25, "before": False})
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    assert train_main(["--config", str(config_file)]) == 0
    summary = json.loads((tmp_path / "out" / "run.json").read_text())
    assert summary["data"]["vision"]["images"] == 16

    # Rows as the run built them: the loss is on the answer and its end-of-turn tokens only.
    processor = load_processor(str(model_dir))
    tok = processor.tokenizer
    splits = build_run_datasets(Config.model_validate(cfg), tok)
    encoder = splits.train[0]["images"].encoder
    for row in splits.train + splits.eval:
        ids, labels = row["input_ids"], row["labels"]
        trained = [t for t in labels if t != -100]
        word = tok.decode(trained).strip().split("<")[0]
        answer = tok(tok.decode(trained).split("<")[0], add_special_tokens=False)["input_ids"]
        assert word in COLORS and tok.decode(trained[len(answer):]) in END_OF_TURN[family]
        assert labels == [-100] * (len(ids) - len(trained)) + trained and ids[-len(trained):] == trained
        assert sum(t in encoder.vision_ids for t in ids) >= 4 and not set(trained) & encoder.vision_ids

    # Cut at the assistant turn or not, the tokens and image tensors are the processor's own.
    row = splits.eval[0]
    record = json.loads(data.read_text().splitlines()[int(row["images"].where.rsplit(":", 1)[1]) - 1])
    with Image.open(row["images"].paths[0]) as im:
        image = im.convert("RGB")
    text = processor.apply_chat_template(record["messages"], tokenize=False)
    whole = processor(text=[text], images=[[image]], add_special_tokens=False, return_tensors="pt")
    batch = collate([row], tok.pad_token_id)
    assert batch["input_ids"][0].tolist() == whole["input_ids"][0].tolist()
    for key in set(whole) & set(batch) - {"input_ids", "attention_mask"}:
        assert torch.equal(batch[key], whole[key]), key

    # The adapter holds LoRA on the language model only; in PEFT on the Transformers class it
    # reproduces the run's held-out loss, and its chunked loss is Transformers' loss.
    tuned = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(model_dir),
                                      tmp_path / "out" / "adapter").eval()
    parts = vision_parts(tuned)
    with safe_open(tmp_path / "out" / "adapter" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k and f".{parts.language}." in f".{k.removeprefix('base_model.model.')}" for k in keys)
    after = heldout_loss(tuned, splits.eval, pad_token_id=tok.pad_token_id, device=torch.device("cpu"),
                         dtype=torch.float32)
    assert after["loss"] == pytest.approx(summary["eval"]["after"]["loss"], abs=1e-5)
    batch = collate(splits.eval[:2] + splits.train[:2], tok.pad_token_id)
    with torch.no_grad():
        ours, n = sft_loss_sum(tuned, batch)
        assert float(ours / n) == pytest.approx(float(tuned(**batch).loss), abs=1e-5)


def test_qwen2_vl_processor_with_a_video_processor_loads_without_torchvision(tmp_path):
    """A hub Qwen2-VL directory names a video processor, which needs torchvision: Transformers'
    AutoProcessor refuses it here; Maximus builds the processor from the image processor and the
    tokenizer, and it encodes an image as the one saved without the video processor does."""
    from PIL import Image
    from transformers import AutoProcessor

    from maximus.vision import load_processor

    model_dir = VLM_BUILDERS["qwen2_vl"](tmp_path / "qwen2_vl")
    saved = load_processor(str(model_dir))
    config = json.loads((model_dir / "processor_config.json").read_text())
    video = {k: v for k, v in config["image_processor"].items() if k != "image_processor_type"}
    config["video_processor"] = {**video, "video_processor_type": "Qwen2VLVideoProcessor"}
    (model_dir / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ImportError, match="Torchvision"):
        AutoProcessor.from_pretrained(str(model_dir))
    processor = load_processor(str(model_dir))
    assert type(processor).__name__ == "Qwen2VLProcessor" and not hasattr(processor, "video_processor")
    image = Image.new("RGB", (40, 32), COLORS["red"])
    text = "<|vision_start|><|image_pad|><|vision_end|>red"
    ours, reference = (p(text=[text], images=[[image]], return_tensors="pt") for p in (processor, saved))
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
    assert ours["input_ids"][0].tolist().count(processor.image_token_id) == 4
