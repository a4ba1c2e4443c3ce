"""The planner for vision-language models: image tokens from the processor's arithmetic, the
tower and projector in the estimate, real `maximus-train` peaks at two image sizes, `maximus plan`
with the largest image per card, and one-line errors."""
from __future__ import annotations

import json

import pytest

from tiny import one_thread  # noqa: F401  (a fixture, used through pytestmark)
from tiny_vlm import build_tiny_llava, draw_image, vlm_config, write_color_chat

from maximus.config import Config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llavas(tmp_path_factory):
    """Tiny LLaVAs at two image sizes: 32 px (16 image tokens) and 96 px (144 image tokens)."""
    root = tmp_path_factory.mktemp("vlm-plan")
    return {size: build_tiny_llava(root / f"llava{size}", image_size=size) for size in (32, 96)}


#: A Qwen2-VL-shaped config.json (no weights): the processor keeps the resolution.
QWEN2_VL = {"model_type": "qwen2_vl", "image_token_id": 151655,
            "text_config": {"model_type": "qwen2_vl_text", "vocab_size": 151936, "hidden_size": 1536,
                            "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                            "num_key_value_heads": 2, "tie_word_embeddings": True},
            "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "mlp_ratio": 4, "num_heads": 16,
                              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}


def _qwen_dir(tmp_path, max_pixels=1280 * 28 * 28):
    d = tmp_path / "qwen2vl"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN2_VL))
    (d / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 56 * 56, "max_pixels": max_pixels,
                                                           "patch_size": 14, "merge_size": 2}))
    return d


def test_llava_image_tokens_are_the_processors(llavas, tmp_path):
    from transformers import AutoProcessor

    from maximus.memory.shape import load_model_config
    from maximus.memory.vision_terms import image_geometry, processor_config, vision_shape

    for size, model in llavas.items():
        processor = AutoProcessor.from_pretrained(model)
        image = draw_image(tmp_path / f"{size}.png", "red", (size * 3, size * 2))
        from PIL import Image

        out = processor(text=["<image>hi"], images=[Image.open(image).convert("RGB")], return_tensors="pt")
        counted = out["input_ids"][0].tolist().count(processor.image_token_id)
        shape = vision_shape(load_model_config(model))
        g = image_geometry(shape, processor_config(model), max_pixels=64 * 64)
        assert (g.tokens, g.patches, g.fixed) == (counted, counted + 1, True) and counted == (size // 8) ** 2
        assert tuple(out["pixel_values"].shape[-2:]) == (g.height, g.width)


@pytest.mark.parametrize("image,max_pixels", [((640, 480), 200_000), ((300, 1000), 50_000), ((100, 90), None),
                                              ((2000, 1500), None)])
def test_qwen2_vl_image_tokens_are_the_processors(tmp_path, image, max_pixels):
    """Maximus' resize to vision.max_pixels, then Qwen2-VL's PIL image processor: the patch grid
    and the merged image tokens equal `image_geometry`'s."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from maximus.data.vision import open_image
    from maximus.memory.vision_terms import image_geometry, processor_config, vision_shape

    d = _qwen_dir(tmp_path, max_pixels=300_000)
    proc = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=300_000, patch_size=14, merge_size=2)
    pil, _ = open_image(draw_image(tmp_path / "x.png", "blue", image), max_pixels)
    grid = proc(images=[pil], return_tensors="pt")["image_grid_thw"][0].tolist()
    g = image_geometry(vision_shape(QWEN2_VL), processor_config(d), max_pixels, image=image)
    assert (g.patches, g.tokens, g.fixed) == (grid[1] * grid[2], grid[1] * grid[2] // 4, False)
    assert (g.height, g.width) == (grid[1] * 14, grid[2] * 14)


def _run(model, tmp_path, name, **sections):
    from maximus.train.trainer import Trainer

    data = write_color_chat(tmp_path / f"data-{name}", n=20)
    cfg = vlm_config(model, data, tmp_path / name, **sections)
    cfg["training"] = {**cfg["training"], "max_steps": 2, "seq_len": 192}
    cfg["eval"] = {"enabled": False}
    Trainer(Config.model_validate(cfg)).train()
    return json.loads((tmp_path / name / "run.json").read_text())


@pytest.mark.parametrize("size,sections", [
    (32, {}),
    (96, {"lora": {"r": 8, "alpha": 16, "vision": True, "projector": True}}),
    (96, {"lora": {"r": 8, "alpha": 16, "vision": True}, "optimization": {"gradient_checkpointing": "full"}}),
], ids=["32px-frozen-tower", "96px-lora-vision-projector", "96px-lora-vision-checkpointed"])
def test_the_plan_predicts_the_measured_peak_within_10_percent(llavas, tmp_path, size, sections):
    """The planner's peak (run.json plan.peak_bytes) against the meter's (memory.peak_bytes), real
    LoRA runs of the tiny LLaVA at 16 and 144 image tokens per row."""
    run = _run(llavas[size], tmp_path, "run", **sections)
    error = run["plan"]["peak_bytes"] / run["memory"]["peak_bytes"] - 1
    assert -0.10 <= error <= 0.10, f"{size}px {sections}: predicted {error:+.1%} of the measured peak"


def test_a_trained_tower_is_checkpointed_with_the_language_model(llavas, tmp_path):
    from maximus.train.trainer import Trainer

    data = write_color_chat(tmp_path / "d", n=8)
    cfg = vlm_config(llavas[32], data, tmp_path / "o", lora={"r": 4, "alpha": 8, "vision": True},
                     optimization={"gradient_checkpointing": "full"})
    trainer = Trainer(Config.model_validate(cfg))
    trainer.setup()
    tower = trainer.model.get_base_model().model.vision_tower
    modes = [layer.__dict__.get("_maximus_recompute") for layer in tower.encoder.layers]
    assert modes == ["full", "full"]


def test_estimate_adds_the_tower_and_projector_terms(llavas):
    """What each switch adds, term by term (rows of one length: no padded attention): the tower and
    projector weights always; LoRA on the tower adds adapters and saved activations; the trained
    projector its float32 copy; checkpointing leaves the tower one input per layer."""
    from maximus.memory.estimate import estimate_peak
    from maximus.memory.shape import load_model_config
    from maximus.memory.vision_terms import VisionSpec, image_geometry, vision_shape

    config = load_model_config(llavas[96])
    shape = vision_shape(config)
    geometry = image_geometry(shape)
    assert (geometry.patches, geometry.tokens) == (145, 144)
    base = dict(method="lora", dtype="fp32", micro_batch=2, seq_len=192, device="cpu", lora_r=8)
    text = estimate_peak(config, **base)
    frozen = estimate_peak(config, vision=VisionSpec(shape, geometry, padded=False), **base)
    assert frozen.breakdown["weights"] - text.breakdown["weights"] == 4 * (shape.tower_params + shape.projector_params)
    assert frozen.breakdown["adapters"] == text.breakdown["adapters"]
    tower = estimate_peak(config, vision=VisionSpec(shape, geometry, padded=False, lora_vision=True,
                                                    tower_targets=("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")),
                          **base)
    h, i = shape.hidden_size, shape.intermediate_size
    assert tower.breakdown["adapters"] - text.breakdown["adapters"] == 4 * shape.num_layers * 8 * (4 * 2 * h + 2 * (h + i))
    assert tower.settings["vision"]["saved"] > 0 and frozen.settings["vision"]["saved"] == 0
    ckpt = estimate_peak(config, vision=VisionSpec(shape, geometry, padded=False, lora_vision=True, tower_targets=("q_proj",)),
                         **dict(base, checkpointing="full"))
    P = 2 * geometry.patches
    assert ckpt.settings["vision"]["saved"] == P * shape.num_layers * h * 4 + P * shape.projector_in * 4 + \
        2 * 2 * geometry.tokens * shape.text_hidden * 4
    projector = estimate_peak(config, vision=VisionSpec(shape, geometry, padded=False, lora_projector=True), **base)
    assert projector.breakdown["weights"] - frozen.breakdown["weights"] == 4 * shape.projector_params


def test_maximus_plan_names_the_image_tokens_and_the_largest_image_per_card(llavas, tmp_path, monkeypatch):
    from maximus import plan_command
    from maximus.plan_command import plan_json

    # Three cards, and no longest-context search (its own tests cover it): the vision columns only.
    monkeypatch.setattr(plan_command, "GPU_CARDS", {k: plan_command.GPU_CARDS[k] for k in ("T4", "L4", "H100")})
    monkeypatch.setattr(plan_command, "max_seq_len_for_budget", lambda *a, **k: None)

    report = plan_json(["--model", str(llavas[96]), "--seq", "192", "--batch", "2", "--json"])
    assert report["vision"] == {"images_per_row": 1, "image_width": 96, "image_height": 96, "image_tokens": 144,
                                "tower_tokens": 145, "fixed_size": True, "tower_trains": False,
                                "projector_trains": False}
    assert all(c["largest_image"] == {"width": 96, "height": 96, "pixels": 9216, "image_tokens": 144,
                                      "fixed_size": True} for c in report["cards"])
    qwen = plan_json(["--model", str(_qwen_dir(tmp_path)), "--method", "qlora", "--seq", "2048", "--batch", "1",
                      "--json"])
    images = {c["card"]: c["largest_image"] for c in qwen["cards"]}
    # H100: the processor's own cap (1280 x 28 x 28 pixels, rounded to whole 28-pixel blocks); T4: less
    assert images["H100"] == {"width": 980, "height": 980, "pixels": 960400, "image_tokens": 1225, "fixed_size": False}
    assert all(image["pixels"] <= 960400 for image in images.values())


def test_largest_image_is_the_largest_that_fits(tmp_path):
    """Just below the budget: the found image fits, a few per cent larger does not."""
    from dataclasses import replace

    from maximus.errors import BudgetError
    from maximus.memory.shape import model_shape
    from maximus.plan_command import largest_image
    from maximus.memory.planner import plan_for_budget
    from maximus.memory.run_spec import keyword_spec
    from maximus.memory.vision_terms import VisionSpec, image_geometry, processor_config, vision_shape

    d = _qwen_dir(tmp_path, max_pixels=16384 * 28 * 28)  # a cap no 8 GB plan reaches with LoRA on the tower
    vshape = vision_shape(QWEN2_VL)
    spec = VisionSpec(vshape, image_geometry(vshape, processor_config(d)), lora_vision=True,
                      tower_targets=("q_proj",), processor=processor_config(d))
    shape = model_shape(QWEN2_VL)
    kw = dict(method="lora", dtype="bf16", lora_r=16, device="cuda")
    budget = 8 * 2**30
    found = largest_image(keyword_spec(shape, dict(kw, vision=spec)), budget, seq_len=20000, micro_batch=1)
    assert 56 * 56 < found["pixels"] < 16384 * 28 * 28

    def fits(pixels):
        g = image_geometry(vshape, spec.processor, pixels)
        try:
            plan_for_budget(shape, budget, batch_size=1, micro_batch_size=1, vision=replace(spec, geometry=g),
                            seq_len=20000 - spec.geometry.tokens + g.tokens, **kw)
            return True
        except BudgetError:
            return False

    assert fits(found["pixels"]) and not fits(int(found["pixels"] * 1.05))


def test_bad_input_is_one_line(llavas, tmp_path, capsys):
    from maximus.cli import main

    assert main(["plan", "--model", str(llavas[96]), "--seq", "100", "--batch", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: training.seq_len 100 is below the 144 image tokens of a row (1 x 96x96 images of 144 "
                   "tokens) (hint: raise training.seq_len or lower vision.max_pixels)"]
    unknown = tmp_path / "mllama"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "mllama", "vision_config": {"image_size": 448},
                                                     "text_config": QWEN2_VL["text_config"]}))
    assert main(["plan", "--model", str(unknown), "--seq", "512", "--batch", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: the memory estimator does not know the vision tower of model type 'mllama' (hint: supported: "
        "llava, gemma3, idefics3, smolvlm, qwen2_vl, qwen2_5_vl (docs/vision.md))"]
