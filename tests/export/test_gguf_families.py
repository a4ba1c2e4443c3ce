"""GGUF export of every family of the matrix beyond Llama / Mistral / Qwen2, checked by llama.cpp
itself (llama-cpp-python): a tiny random model of each class (tests/tiny.py's family shapes) gets a
LoRA adapter trained 2 steps (the experts' too, for a mixture of experts), `maximus export --format
gguf --quant f32` writes it, and llama.cpp must

- tokenize the held-out strings as the Transformers tokenizer does;
- continue a prompt greedily, 32 tokens, exactly as the merged Transformers model does, past the
  16-token sliding windows of Gemma 2 / 3 and gpt-oss;
- give the same next-token logits at every position of that text, within 1e-4 of the largest
  (f32 weights and an f32 KV cache; 1e-3 for Gemma, whose GELU llama.cpp reads from a table).

The weights are drawn so that every family-specific part decides the result: sharp attention (Q/K at
std 0.15, so the RoPE layout and scale matter), random norms (Gemma's `1 + w`), decisive routers
(std 1: the top-k experts are never near a tie), random biases and attention sinks, and Gemma 2's
attention soft-cap lowered to 2.0 so that it bends every attention score.

Where llama.cpp hard-codes a behaviour the config could change, the export refuses in one line
(`test_configs_llama_cpp_cannot_run_are_refused_in_one_line`, in test_export_gguf_files.py's style).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from maximus.cli import main

from conftest import HELD_OUT, PROMPTS, train_tiny_run
from tiny import LLAMA_CPP_MARKS, build_family_model_dir, llama_cpp_or_skip, one_thread  # noqa: F401  (one_thread: a fixture, used through pytestmark)

llama_cpp = llama_cpp_or_skip()
pytestmark = LLAMA_CPP_MARKS

#: Config fields per family on top of tests/tiny.py's: the shapes llama.cpp takes as they are.
FAMILIES = {
    "qwen3": {}, "phi3": {}, "olmo2": {}, "granite": {}, "mixtral": {},
    "gemma2": {"tie": True, "attn_logit_softcapping": 2.0},  # llama.cpp's gemma2 always ties its head
    "gemma3_text": {},
    "qwen3_moe": {"norm_topk_prob": True},  # llama.cpp's qwen3moe always renormalises the top-k weights
    "gpt_oss": {"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": True, "original_max_position_embeddings": 64,
                                    "rope_theta": 150000.0}},
}


#: Logit tolerance, relative to the largest logit: f32 everywhere; Gemma's GELU is computed by
#: llama.cpp's CPU backend from a float16 table (about 4e-4 measured here).
TOLERANCE = {"gemma2": 1e-3, "gemma3_text": 1e-3}


def _decisive(model) -> None:
    """Weights under which a wrong layout, scale or routing changes the output (module docstring)."""
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
            p.normal_(0, 0.15)
        elif name.endswith("norm.weight"):
            p.add_(torch.randn_like(p) * 0.2)
        elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
            p.normal_(0, 1.0)
        elif name.endswith(("bias", "sinks")):
            p.normal_(0, 0.2)


class Exported:
    """A family's trained run, its merged Transformers model, and llama.cpp on its f32 export."""

    def __init__(self, root, model_type: str):
        from maximus.export import load_tuned

        fields = dict(FAMILIES[model_type])
        base = build_family_model_dir(root / "base", model_type, tie=fields.pop("tie", False), prepare=_decisive,
                                      **fields)
        run = train_tiny_run(base, root / "run", steps=2, eval={"split": 0.0, "before": False})
        self.model, self.tokenizer = load_tuned(run, merge=True)
        self.path = root / "model-f32.gguf"
        assert main(["export", str(run), "--format", "gguf", "--quant", "f32", "--out", str(self.path)]) == 0
        # an f32 KV cache (llama.cpp's default is f16, which alone moves logits by ~5e-4)
        self.llm = llama_cpp.Llama(str(self.path), n_ctx=256, n_threads=1, logits_all=True, verbose=False, seed=0,
                                   type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)

    def hf_greedy(self, ids: list[int], steps: int) -> list[int]:
        out, past, new = list(ids), None, torch.tensor([ids])
        with torch.no_grad():
            for _ in range(steps):
                result = self.model(input_ids=new, past_key_values=past, use_cache=True)
                past, token = result.past_key_values, int(result.logits[0, -1].argmax())
                out.append(token)
                new = torch.tensor([[token]])
        return out

    def llama_greedy(self, ids: list[int], steps: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(ids)
        out = list(ids)
        for _ in range(steps):
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            out.append(token)
            self.llm.eval([token])
        return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def exported(request, tmp_path_factory):
    case = Exported(tmp_path_factory.mktemp(request.param), request.param)
    yield case
    case.llm.close()


def test_llama_cpp_tokenizes_greedy_decodes_and_scores_like_transformers(exported):
    for text in HELD_OUT:
        assert exported.llm.tokenize(text.encode("utf-8"), add_bos=True, special=True) == \
            exported.tokenizer(text)["input_ids"], text
    ids = exported.tokenizer(PROMPTS[0])["input_ids"]
    greedy = exported.hf_greedy(ids, 32)
    assert exported.llama_greedy(ids, 32) == greedy
    ids = greedy  # every position of the continuation, scored at once
    exported.llm.reset()
    exported.llm.eval(ids)
    ours = np.array(exported.llm.scores[: len(ids)], dtype=np.float64)
    with torch.no_grad():
        hf = exported.model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    rel = np.abs(ours - hf).max(axis=-1) / np.abs(hf).max(axis=-1)
    assert rel.max() < TOLERANCE.get(exported.model.config.model_type, 1e-4), rel.max()
