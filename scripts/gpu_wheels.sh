#!/usr/bin/env bash
# On a machine with PyPI: download what `kava-ray bench gpu` needs beyond torch and transformers into
# .gpu_wheels/ (git-ignored), for a GPU machine without network (scripts/gpu_check.sh installs them there).
#   pydantic (+ pydantic-core, annotated-types, typing-inspection)  configs        ~2.5 MB
#   torchao                                                          bf16-sr        ~ 7 MB
#   bitsandbytes                                                     the NF4 teacher ~43 MB
# PY: the GPU machine's Python (default 3.12). NO_BNB=1 leaves bitsandbytes out (the 8 GB run then uses a bf16
# teacher and says so) when the carry limit is tight.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-3.12}"
DEST=.gpu_wheels
rm -rf "$DEST" && mkdir -p "$DEST"
pkgs=(pydantic pydantic-core annotated-types typing-inspection torchao)
[[ "${NO_BNB:-0}" == 1 ]] || pkgs+=(bitsandbytes)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
    -d "$DEST" "${pkgs[@]}"
du -ch "$DEST"/*.whl
