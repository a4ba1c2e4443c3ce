#!/usr/bin/env bash
# Wheels the GPU device lacks, for `benchmarks/gpu.sh` (the device cannot reach PyPI). Run here, in the
# repository root; writes .whl/ (ignored by git: .git/info/exclude), about 60 MB with bitsandbytes'
# CUDA binaries. The device's image (KINDS.md) has Python 3.12, torch, triton, accelerate, tokenizers,
# safetensors and huggingface_hub, but no bitsandbytes or pydantic; transformers and peft are carried
# at the versions the CPU runs use, so both machines run the same library code.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl bitsandbytes==0.50.2 transformers==5.24.0 peft==0.21.2 pydantic==2.13.4 pydantic-core==2.46.4 \
    annotated-types==0.7.0 typing-inspection==0.4.2
du -ch .whl/*.whl | tail -1
