#!/usr/bin/env bash
# Wheels the GPU device lacks, for `benchmarks/gpu.sh` (the device cannot reach PyPI). Run here, in the
# root of the checkout the device call sends; writes .whl/ (ignored by git), about 60 MB with
# bitsandbytes' CUDA binaries, then `gpu.sh preflight` checks that the call stays under 64 MiB.
# The device's image (benchmarks/gpu_image_packages.txt) has Python 3.12, torch 2.11, triton, accelerate, tokenizers, safetensors
# and huggingface_hub, but no bitsandbytes or pydantic; transformers and peft are carried at the versions
# the CPU runs use, so both machines run the same library code; typing_extensions because
# pydantic-core needs 4.14 or newer (`Sentinel`) and the image's version is not known; rensa and ftfy
# (with wcwidth) because every run's data check imports them. benchmarks/gpu_image_packages.txt lists
# the image's packages; tests/benchmarks/test_gpu_dry.py checks that each dependency of Maximus is
# there, here, or named there as off the check's paths.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl bitsandbytes==0.50.2 transformers==5.24.0 peft==0.21.2 pydantic==2.13.4 pydantic-core==2.46.4 \
    annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0 rensa==0.5.0 ftfy==6.3.1 wcwidth==0.7.0
# bitsandbytes ships one library per CUDA / ROCm / XPU version (43 MB): keep the CPU one and CUDA 12.8-13.2's
# (the device's torch is built for CUDA 13.0; bitsandbytes loads the library of torch.version.cuda), and
# drop the rest from the wheel and its RECORD, which leaves room under the 64 MiB a device call carries.
python3 - .whl/bitsandbytes-*.whl <<'PY'
import re, sys, zipfile
from pathlib import Path

wheel = Path(sys.argv[1])
keep = re.compile(r"libbitsandbytes_(cpu|cuda12[89]|cuda13\d)\.so$")
dropped = lambda name: "/libbitsandbytes_" in name and not keep.search(name)
stripped = wheel.with_suffix(".tmp")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(stripped, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if dropped(item.filename):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(ln for ln in data.splitlines(keepends=True) if not dropped(ln.decode().split(",")[0]))
        dst.writestr(item, data)
stripped.replace(wheel)
PY
du -ch .whl/*.whl | tail -1
bash benchmarks/gpu.sh preflight
