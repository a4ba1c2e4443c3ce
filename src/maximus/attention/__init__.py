"""Kronecker Sketching attention: strictly causal detail + sketch attention, linear in context.

Public: `install_kronecker(model, settings) -> model`, `kronecker_module_names(model) -> list[str]`,
`KroneckerSketch` (the per-layer parameters) and `kronecker_sketch_attention` (the functional core).
Design and causality argument: docs/kronecker.md.
"""
from maximus.attention.install import install_kronecker, kronecker_module_names
from maximus.attention.kronecker import kronecker_sketch_attention
from maximus.attention.sketch_module import KroneckerSketch

__all__ = ["KroneckerSketch", "install_kronecker", "kronecker_module_names", "kronecker_sketch_attention"]
