"""The estimate models LoRA's options (`maximus.memory.adapter_terms`): `lora.modules_to_save`, DoRA
and LoRA dropout, each on a real `maximus.Trainer` run of a tiny model (fp32, CPU meter), and the
embedded quickstart (which trains embed_tokens and lm_head) against its own measured peak.

The model has a vocabulary of 8,192 rows, so that full copies of the embedding and the head weigh
as much as they do in real models. Each option must also move the prediction by what it moves the
measured peak: an option cannot pass by being absorbed by the margin.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

import maximus
from maximus.memory.adapter_terms import adapter_terms
from maximus.memory.estimate import estimate_peak
from maximus.memory.shape import model_shape
from tiny import build_vocab8k_llama, measure_text, measured_run
from tiny import one_thread  # noqa: F401  (a fixture, used through pytestmark)

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter_terms")
    build_vocab8k_llama(root / "model", max_positions=1024)
    rng = random.Random(0)
    (root / "text.jsonl").write_text("".join(json.dumps({"text": measure_text(rng, 300)}) + "\n" for _ in range(16)),
                                     encoding="utf-8")
    return root


def _run(tiny: Path, out: Path, lean_lora: bool = True, **lora) -> tuple[int, int]:
    """(predicted, measured) peak of two real fp32 steps of 2 x 256 tokens."""
    cfg = maximus.Config.from_dict({
        "model": str(tiny / "model"), "dataset": {"path": str(tiny / "text.jsonl"), "format": "text"},
        "method": "lora", "output_dir": str(out), "device": "cpu", "lora": {"r": 4, "alpha": 8, **lora},
        "optimization": {"gradient_checkpointing": "off", "lean_lora": lean_lora},
        "training": {"batch_size": 2, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3, "warmup_steps": 0,
                     "seq_len": 256, "dtype": "fp32", "packing": True},
        "eval": {"enabled": False, "before": False}, "logging": {"progress": "none"}})
    return measured_run(cfg)[:2]


@pytest.fixture(scope="module")
def plain(tiny, tmp_path_factory):
    """LoRA without options on PEFT's forward (what DoRA and dropout fall back to)."""
    return _run(tiny, tmp_path_factory.mktemp("peft"), lean_lora=False)


def _check(run: tuple[int, int], plain: tuple[int, int]) -> None:
    predicted, measured = run
    assert predicted == pytest.approx(measured, rel=0.10)
    change = measured - plain[1]
    assert change > 0.1 * plain[1]  # the option does cost memory
    assert predicted - plain[0] == pytest.approx(change, rel=0.25)


def test_modules_to_save_trains_full_copies_of_embedding_and_head(tiny, tmp_path, plain):
    # copies (4 MiB each), their AdamW moments, the head's gradient accumulator in the loss
    _check(_run(tiny, tmp_path, lean_lora=False, modules_to_save=["embed_tokens", "lm_head"]), plain)


def test_dora_magnitudes_and_saved_results(tiny, tmp_path, plain):
    _check(_run(tiny, tmp_path, use_dora=True), plain)


def test_lora_dropout_masks_and_inputs(tiny, tmp_path, plain):
    _check(_run(tiny, tmp_path, dropout=0.1), plain)


def test_adapter_terms_count_what_peft_builds(tiny):
    """The trainable parameters the terms add are PEFT's own count, option by option."""
    from peft import LoraConfig, get_peft_model

    shape = model_shape(tiny / "model")
    targets = list(shape.linear_shapes())
    for options in ({"modules_to_save": ["embed_tokens", "lm_head"]}, {"use_dora": True}):
        model = LlamaForCausalLM.from_pretrained(str(tiny / "model"))
        plain = get_peft_model(LlamaForCausalLM.from_pretrained(str(tiny / "model")),
                               LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **options))
        count = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)  # noqa: E731
        assert adapter_terms(shape, targets, 4, **options).trainable_params == count(peft) - count(plain)


def test_an_unknown_module_to_save_is_a_note():
    e = estimate_peak("meta-llama/Llama-3.2-1B", modules_to_save=["score"], device="cpu")
    assert "lora.modules_to_save 'score': not a module the estimator knows, its copy is not counted" in e.notes
    full = estimate_peak("meta-llama/Llama-3.2-1B", method="full", modules_to_save=["lm_head"], use_dora=True)
    assert full.peak_bytes == estimate_peak("meta-llama/Llama-3.2-1B", method="full").peak_bytes


def test_the_quickstart_prediction_holds(tmp_path, monkeypatch):
    """The embedded default (embed_tokens and lm_head trained, `target_vram: 100MB`) on 200 of its
    rows (packed: every row is seq_len tokens, as with all of them): the planned peak is within
    5 % of what two of its steps measure (its many short documents take the masked attention call)."""
    from maximus.builtin import resolve

    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path / "cache"))
    cfg = resolve(maximus.Config.from_yaml(ROOT / "examples" / "quickstart.yaml"))
    rows = (Path(cfg.datasets[0].path) / "train.jsonl").read_text().splitlines()[:200]
    (tmp_path / "rows.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    d = cfg.to_dict()
    d.update(dataset={"path": str(tmp_path / "rows.jsonl"), "format": "prompt_completion"},
             output_dir=str(tmp_path / "run"), eval={"enabled": False, "before": False}, logging={"progress": "none"},
             training={**d["training"], "max_steps": 2})
    _, _, run = measured_run(maximus.Config.from_dict(d))
    assert (run["plan"]["micro_batch_size"], run["plan"]["grad_accum"]) == (8, 2)
    assert run["plan"]["peak_bytes"] == pytest.approx(run["memory"]["peak_bytes"], rel=0.05)
