"""The private hooks of maximus.compat resolve with the installed libraries, a hook that stops
resolving is named, and pyproject.toml bounds each hooked library to what was tested."""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

from maximus import compat

ROOT = Path(__file__).resolve().parents[2]


def test_every_private_hook_resolves():
    assert compat.broken_hooks() == []


def test_a_hook_that_no_longer_resolves_is_named(monkeypatch):
    import transformers.models.mistral.modeling_mistral as mistral

    monkeypatch.delattr(mistral, "apply_rotary_pos_emb")
    monkeypatch.setattr(compat, "TRL_FUSED_CLOSURE", compat.TRL_FUSED_CLOSURE | {"logit_softcap"})
    assert compat.broken_hooks() == [
        "trl.trainer.utils.add_fused_lm_head: _fused_forward and its closure names (used by maximus.hf_patch): "
        "_fused_forward's closure lacks ['logit_softcap']",
        "apply_rotary_pos_emb in Transformers' Llama / Mistral / Qwen2 modeling modules (used by "
        "maximus.kernels.triton.install): transformers.models.mistral.modeling_mistral.apply_rotary_pos_emb is gone",
    ]


def test_pyproject_bounds_the_hooked_libraries_to_the_tested_versions():
    text = (ROOT / "pyproject.toml").read_text()
    requirements = {Requirement(r).name: Requirement(r) for r in re.findall(r'"([a-z_-]+[<>=][^"]*)"', text)}
    for name in ("transformers", "peft", "trl", "bitsandbytes"):
        spec = requirements[name].specifier
        assert any(s.operator == "<" for s in spec), f"{name} has no upper bound"
        assert compat.TESTED_VERSIONS[name] in spec and md.version(name) in spec, name


def test_the_hooked_code_reads_its_names_from_compat():
    """hf_patch no longer spells TRL's private names itself."""
    source = (ROOT / "src/maximus/hf_patch.py").read_text()
    assert '"_fused_forward"' not in source and '"cast_lm_head_to_fp32"}' not in source
    assert "torch._C._current_graph_task_id" not in (ROOT / "src/maximus/kernels/tiled_mlp.py").read_text()
    assert sys.modules["maximus.compat"] is compat
