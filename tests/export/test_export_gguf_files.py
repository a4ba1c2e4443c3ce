"""GGUF / Ollama exports without llama.cpp: refusals (quant, architecture, tokenizer, target),
the Modelfile, and the Jinja -> Ollama template translation checked against Transformers' rendering."""
from __future__ import annotations

import json

import pytest

from maximus.cli import main
from maximus.data.templates import CHATML_TEMPLATE, FALLBACK_CHAT_TEMPLATE
from maximus.data.tiny_tokenizer import build_tiny_tokenizer
from maximus.errors import ExportError
from maximus.export.ollama import chat_pieces, modelfile
from maximus.export.target import GGUF_MARKER_KEY, MARKER
from maximus.export.to_gguf import check_architecture

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}],
]


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, FALLBACK_CHAT_TEMPLATE], ids=["chatml", "fallback"])
def test_template_pieces_reproduce_transformers_rendering(template):
    tok = build_tiny_tokenizer(vocab_size=300, chat_template=template)
    pieces = chat_pieces(tok, strip_bos=False)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert pieces.render(messages, gen) == tok.apply_chat_template(messages, tokenize=False,
                                                                           add_generation_prompt=gen)


def test_chatml_modelfile_exact():
    tok = build_tiny_tokenizer(vocab_size=300, chat_template=CHATML_TEMPLATE)
    user = "<|im_start|>user\n{{ .Content }}<|im_end|>\n"
    assert modelfile("model.gguf", tok, add_bos=False) == (
        'FROM ./model.gguf\n\nTEMPLATE """{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}'
        '{{ if eq .Role "system" }}<|im_start|>system\n{{ .Content }}<|im_end|>\n'
        '{{ else if eq .Role "user" }}{{ if eq $i 0 }}' + user + '{{ else }}' + user + '{{ end }}'
        '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n{{ .Content }}<|im_end|>\n{{ end }}'
        '{{ if and $last (ne .Role "assistant") }}<|im_start|>assistant\n{{ end }}{{ end }}"""\n\n'
        'PARAMETER stop "<|endoftext|>"\nPARAMETER stop "<|im_end|>"\n')


def test_template_that_is_not_a_per_message_wrap_is_refused():
    # numbers each turn: a longer conversation renders differently from its pieces
    counting = ("{% for m in messages %}{{ loop.length }}:{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    tok = build_tiny_tokenizer(vocab_size=300, chat_template=counting)
    with pytest.raises(ExportError) as info:
        modelfile("model.gguf", tok, add_bos=False)
    assert str(info.value) == ("the chat template re-renders earlier messages when one is added (hint: Ollama needs a "
                               "per-message template; use --format gguf (it keeps the Jinja template))")


def test_unsupported_architecture_names_the_supported_ones():
    from transformers import GPT2Config

    with pytest.raises(ExportError) as info:
        check_architecture(GPT2Config())
    assert str(info.value) == ("model type 'gpt2' has no GGUF export (hint: supported: llama, mistral, mixtral, "
                               "granite, qwen2, qwen3, qwen3_moe, gemma2, gemma3_text, phi3, olmo2, gpt_oss; "
                               "--format merged works for any model)")


@pytest.mark.parametrize("model_type, fields, message", [
    ("qwen3_moe", {"num_experts": 4, "norm_topk_prob": False},
     "Qwen3-MoE (qwen3_moe) has no GGUF export for this config: norm_topk_prob is false, but llama.cpp's qwen3moe "
     "always renormalises the top-k routing weights"),
    ("qwen3_moe", {"num_experts": 4, "norm_topk_prob": True, "mlp_only_layers": [0]},
     "Qwen3-MoE (qwen3_moe) has no GGUF export for this config: it has dense MLP layers (mlp_only_layers / "
     "decoder_sparse_step), and llama.cpp's qwen3moe makes every layer a mixture of experts"),
    ("gpt_oss", {"swiglu_limit": 10.0},
     "gpt-oss (gpt_oss) has no GGUF export for this config: swiglu_limit is 10.0, but llama.cpp's gpt-oss computes "
     "its SwiGLU with swiglu_limit 7.0"),
    ("gemma2", {"tie_word_embeddings": False},
     "Gemma 2 (gemma2) has no GGUF export for this config: its output head is untied (tie_word_embeddings: false), "
     "but llama.cpp's gemma2 uses the embeddings as the head"),
    ("gemma3_text", {"head_dim": 16, "query_pre_attn_scalar": 64},
     "Gemma 3 (text) (gemma3_text) has no GGUF export for this config: query_pre_attn_scalar is 64, but llama.cpp "
     "scales this shape's queries by 1/sqrt(16)"),
])
def test_configs_llama_cpp_cannot_run_are_refused_in_one_line(model_type, fields, message):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, num_hidden_layers=2, hidden_size=64, num_attention_heads=4, **fields)
    with pytest.raises(ExportError) as info:
        check_architecture(config)
    assert str(info.value) == f"{message} (hint: --format merged keeps the model as it is)"


def test_a_family_the_installed_gguf_does_not_know_is_refused_by_the_cli(lora_run, tmp_path, capsys, monkeypatch):
    import dataclasses
    from importlib.metadata import version

    from maximus.export import gguf_arch

    # as with a gguf package older than the architecture
    monkeypatch.setitem(gguf_arch.GGUF_ARCHS, "llama", dataclasses.replace(gguf_arch.GGUF_ARCHS["llama"], arch="LLAMA9"))
    out = tmp_path / "m.gguf"
    assert main(["export", str(lora_run), "--format", "gguf", "--out", str(out)]) == 2
    assert _err(capsys) == (f"error: Llama (llama) has no GGUF export with gguf {version('gguf')}: the package does "
                            "not know llama.cpp's llama9 architecture (hint: pip install -U gguf, or use --format "
                            "merged)")
    assert not out.exists()


def test_unsupported_tokenizer_names_the_supported_ones():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from maximus.export.gguf_vocab import build_vocab

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ExportError) as info:
        build_vocab(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]"), 2)
    assert str(info.value) == ("the tokenizer (WordLevel model, Whitespace pre-tokenizer) has no exact llama.cpp "
                               "equivalent (hint: GGUF export supports byte-level BPE (GPT-2, Llama-3 or Qwen2 "
                               "pre-tokenizer) and SentencePiece-style BPE with byte fallback)")


def test_unknown_quant_is_refused_naming_the_supported_ones(lora_run, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["export", str(lora_run), "--format", "gguf", "--quant", "iq2_xxs", "--out", str(out)]) == 2
    assert _err(capsys) == ("error: --quant iq2_xxs is not supported (the gguf package writes: f32, f16, bf16, q8_0, "
                            "q5_1, q5_0, q4_1, q4_0; with llama-cpp-python installed, llama.cpp's quantiser adds: "
                            "q2_k, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k) "
                            "(hint: pick one of those)")
    assert not out.exists()


def test_k_quant_without_llama_cpp_is_refused(lora_run, tmp_path, capsys, monkeypatch):
    import maximus.export.to_gguf as to_gguf

    monkeypatch.setattr(to_gguf, "_llama_cpp", lambda: None)  # as on a machine without llama-cpp-python
    out = tmp_path / "m.gguf"
    assert main(["export", str(lora_run), "--format", "gguf", "--quant", "q4_k_m", "--out", str(out)]) == 2
    assert _err(capsys) == ("error: --quant q4_k_m needs llama.cpp's own quantiser (llama-cpp-python), which is not "
                            "installed; the gguf package alone writes: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0 "
                            "(hint: pip install 'maximusllm[llamacpp]', or pick one of those)")
    assert not out.exists()


def test_quant_with_merged_format_is_an_error(lora_run, tmp_path, capsys):
    assert main(["export", str(lora_run), "--quant", "q8_0", "--out", str(tmp_path / "m")]) == 2
    assert _err(capsys) == ("error: --quant applies to --format gguf, gguf-lora or ollama, not merged "
                            "(hint: drop --quant or change --format)")


def test_kronecker_run_is_refused(lora_run, tmp_path, capsys):
    run = tmp_path / "kron-run"
    run.mkdir()
    summary = json.loads((lora_run / "run.json").read_text())
    summary["config"]["optimization"]["kronecker_sketching"] = True
    (run / "run.json").write_text(json.dumps(summary))
    assert main(["export", str(run), "--format", "gguf", "--out", str(tmp_path / "k.gguf")]) == 2
    assert _err(capsys) == (f"error: {run} was trained with Kronecker sketching attention, which llama.cpp does not "
                            "implement (hint: use --format merged or adapter (they keep the sketch modules))")


def test_gguf_target_rules(lora_run, tmp_path, capsys):
    import gguf

    foreign = tmp_path / "someone-elses.gguf"
    foreign.write_bytes(b"GGUF but not ours")
    assert main(["export", str(lora_run), "--format", "gguf", "--out", str(foreign), "--overwrite"]) == 2
    assert _err(capsys) == (f"error: --out {foreign} already exists and was not written by a Maximus export "
                            "(hint: give a new file path; nothing was changed)")
    assert foreign.read_bytes() == b"GGUF but not ours"

    assert main(["export", str(lora_run), "--format", "gguf", "--out", str(tmp_path / "model.bin")]) == 2
    assert _err(capsys) == (f"error: --out {tmp_path / 'model.bin'} should name a .gguf file "
                            "(hint: e.g. --out model-q8_0.gguf)")

    out = tmp_path / "model.gguf"
    assert main(["export", str(lora_run), "--format", "gguf", "--quant", "q8_0", "--out", str(out)]) == 0
    first = out.read_bytes()
    fields = gguf.GGUFReader(str(out)).fields
    assert json.loads(bytes(fields[GGUF_MARKER_KEY].parts[-1]).decode())["quant"] == "q8_0"
    capsys.readouterr()
    assert main(["export", str(lora_run), "--format", "gguf", "--out", str(out)]) == 2
    assert _err(capsys) == f"error: --out {out} holds a previous export (hint: pass --overwrite to replace it)"
    assert out.read_bytes() == first
    assert main(["export", str(lora_run), "--format", "gguf", "--out", str(out), "--overwrite"]) == 0
    reader = gguf.GGUFReader(str(out))
    assert {t.tensor_type.name for t in reader.tensors} == {"F16", "F32"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "someone-elses.gguf"]


def test_ollama_directory(lora_run, tmp_path):
    import gguf

    out = tmp_path / "ollama"
    assert main(["export", str(lora_run), "--format", "ollama", "--out", str(out)]) == 0
    marker = json.loads((out / MARKER).read_text())
    assert marker["files"] == ["Modelfile", "model.gguf"] and marker["quant"] == "q8_0"
    # the run's tokenizer has no chat template (prompt/completion data): the prompt passes through as is
    assert (out / "Modelfile").read_text() == ('FROM ./model.gguf\n\nTEMPLATE """{{ .Prompt }}"""\n\n'
                                               'PARAMETER stop "<|endoftext|>"\n')
    assert "Q8_0" in {t.tensor_type.name for t in gguf.GGUFReader(str(out / "model.gguf")).tensors}


def _tiny(cls_config, cls_model, **extra):
    import torch

    torch.manual_seed(0)
    return cls_model(cls_config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, **extra))


def test_mistral_sliding_window_is_a_notice(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    from maximus.export.to_gguf import write_gguf

    model = _tiny(MistralConfig, MistralForCausalLM, sliding_window=64)
    notices = write_gguf(model, build_tiny_tokenizer(vocab_size=300), tmp_path / "m.gguf", quant="f16")
    assert notices == ["sliding_window=64 is not representable in llama.cpp's llama architecture: it attends over "
                       "all 256 positions (identical up to 64 tokens)"]


def test_unsupported_rope_scaling_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from maximus.export.to_gguf import write_gguf

    model = _tiny(LlamaConfig, LlamaForCausalLM, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                  "factor": 2.0})
    with pytest.raises(ExportError) as info:
        write_gguf(model, build_tiny_tokenizer(vocab_size=300), tmp_path / "m.gguf", quant="f16")
    assert str(info.value) == "RoPE scaling 'dynamic' has no GGUF export yet (hint: supported: default, linear, llama3, yarn)"


_GO_RENDER = """package main

import (
	"encoding/json"
	"os"
	"text/template"
)

type Message struct{ Role, Content string }

func main() {
	var in struct {
		Template string
		Messages []Message
	}
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		panic(err)
	}
	t := template.Must(template.New("t").Parse(in.Template))
	if err := t.Execute(os.Stdout, map[string]any{"Messages": in.Messages}); err != nil {
		panic(err)
	}
}
"""


@pytest.mark.skipif(__import__("shutil").which("go") is None and __import__("os").environ.get("CI") != "true",
                    reason="Go is not installed (apt-get install golang-go); CI installs it")
@pytest.mark.parametrize("template", [CHATML_TEMPLATE, FALLBACK_CHAT_TEMPLATE], ids=["chatml", "fallback"])
def test_modelfile_template_runs_in_go_text_template_like_transformers(template, tmp_path):
    """Ollama executes TEMPLATE with Go's text/template over .Messages; run ours there."""
    import os
    import subprocess

    tok = build_tiny_tokenizer(vocab_size=300, chat_template=template)
    text = modelfile("model.gguf", tok, add_bos=False)
    go_template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    (tmp_path / "render.go").write_text(_GO_RENDER)
    env = {**os.environ, "GOCACHE": str(tmp_path / "gocache"), "GO111MODULE": "off", "GOFLAGS": ""}
    binary = tmp_path / "render"
    subprocess.run(["go", "build", "-o", str(binary), str(tmp_path / "render.go")], check=True, env=env, cwd=tmp_path)
    for messages in CONVERSATIONS:
        out = subprocess.run([str(binary)], input=json.dumps({"Template": go_template, "Messages": messages}),
                             capture_output=True, text=True, check=True).stdout
        gen = messages[-1]["role"] != "assistant"
        assert out == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
