"""The estimate on a grid of configs equals the values recorded before its restructure into
`StepSpec` + static / layers / backward walk / loss / workspace (`maximus.memory.estimate`): a
change of structure must not change a number. A deliberate change of the model re-records them:
``python tests/memory/test_estimate_recorded.py --record`` (and says why in its commit).
"""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from maximus.errors import MaximusError
from maximus.memory.estimate import estimate_peak, estimate_step, step_of
from maximus.memory.run_spec import Candidate, LoraSettings, RunSpec
from maximus.memory.shape import model_shape

RECORDED = Path(__file__).parent / "recorded" / "estimate_grid.json"

MODELS = {"llama8b": "meta-llama/Llama-3.1-8B", "qwen05b": "Qwen/Qwen2.5-0.5B", "llama1b": "meta-llama/Llama-3.2-1B",
          "moe": {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2048,
                  "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "num_local_experts": 8,
                  "num_experts_per_tok": 2},
          "gemma2": {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
                     "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}}
TECHNIQUES = [dict(loss_mode="naive"), dict(loss_mode="ghost", ghost_candidates=512), dict(loss_chunk_tokens=128),
              dict(offload_activations=True, checkpointing="full"), dict(offload_optimizer=True), dict(grad_accum=4),
              dict(world_size=4), dict(world_size=4, sharded=False),
              dict(attention="kronecker", kronecker={"detail_tokens": 256, "sketch_slots": 64, "block": 64}),
              dict(attention="kronecker", checkpointing="selective"), dict(objective="dpo"),
              dict(objective="dpo", dpo_reference="precomputed"), dict(objective="contrastive"),
              dict(objective="grpo", completion_tokens=256),
              dict(matryoshka_dims=[64, 128]), dict(matryoshka_dims=[64], matryoshka_token_fraction=1.0),
              dict(offload_params=True), dict(tile_tokens=512, checkpointing="full"), dict(lean_lora=True),
              dict(lean_norm=False), dict(optimizer="adamw_8bit"), dict(optimizer_in_backward=True),
              dict(modules_to_save=["lm_head", "embed_tokens", "norm", "q_proj"]), dict(use_dora=True),
              dict(lora_dropout=0.1), dict(lora_targets=["q_proj", "v_proj"]), dict(lora_r=64), dict(lora_experts=False),
              dict(grouped_experts=False, device="cpu")]
INVALID = [dict(method="x"), dict(dtype="x"), dict(loss_mode="x"), dict(micro_batch=0), dict(checkpointing="x"),
           dict(checkpointing=[True]), dict(checkpointing=["bogus"] * 16), dict(attention="x"), dict(objective="x"),
           dict(loss_mode="ghost", objective="dpo"), dict(lora_targets=["nope"])]


def grid() -> list[tuple[str, dict]]:
    cases = []
    for (name, _), method, dtype, gc, device in itertools.product(
            MODELS.items(), ["lora", "qlora", "full"], ["bf16", "fp32"], ["off", "full", "selective", 2], ["cuda", "cpu"]):
        cases.append((name, dict(method=method, dtype=dtype, checkpointing=gc, device=device, micro_batch=2,
                                 seq_len=1024)))
    for name in ("qwen05b", "moe"):
        for extra, method in itertools.product(TECHNIQUES, ["lora", "full", "qlora"]):
            cases.append((name, dict(dict(method=method, device="cuda", micro_batch=1, seq_len=2048), **extra)))
    cases += [("llama1b", extra) for extra in INVALID]
    return cases


def _key(name: str, kw: dict) -> str:
    return name + " " + json.dumps(kw, sort_keys=True)


def _outcome(name: str, kw: dict) -> dict:
    try:
        e = estimate_peak(MODELS[name], **kw)
    except MaximusError as exc:
        return {"error": str(exc)}
    return {"peak_bytes": e.peak_bytes, "breakdown": e.breakdown, "phase": e.phase, "host_bytes": e.host_bytes,
            "tokens_per_s_guess": round(e.tokens_per_s_guess, 3), "notes": e.notes}


def test_the_estimate_equals_the_recorded_grid():
    recorded = json.loads(RECORDED.read_text(encoding="utf-8"))
    cases = grid()
    assert len(recorded) == len(cases)
    differ = [k for k, v in ((_key(n, kw), _outcome(n, kw)) for n, kw in cases) if recorded[k] != v]
    assert not differ, f"{len(differ)} of {len(cases)} estimates changed, e.g. {differ[:3]}"


def test_a_spec_and_a_candidate_are_estimated_as_the_keywords_are():
    spec = RunSpec(shape=model_shape(MODELS["llama8b"]), lora=LoraSettings(r=16))
    cand = Candidate(method="qlora", checkpointing=["full", "none"] * 16, micro_batch=2)
    step = step_of(spec, cand)
    assert step.policy == ("full", "none") * 16 and step.T == 2 * 2048 and step.shard == 1
    assert estimate_step(spec, cand) == estimate_peak(MODELS["llama8b"], method="qlora",
                                                      checkpointing=["full", "none"] * 16, micro_batch=2)
    with pytest.raises(AttributeError):
        spec.dtype = "fp32"  # frozen: one description of the run


if __name__ == "__main__" and "--record" in sys.argv:
    RECORDED.write_text(json.dumps({_key(n, kw): _outcome(n, kw) for n, kw in grid()}, indent=0, sort_keys=True) + "\n",
                        encoding="utf-8")
    print(f"recorded {len(grid())} estimates in {RECORDED}")
