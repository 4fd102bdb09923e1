#!/usr/bin/env bash
# One command on a CUDA machine (no Ray, no network needed): install the wheels scripts/gpu_wheels.sh fetched
# (when .gpu_wheels/ is there), run `kava-ray bench gpu` from this checkout, write its JSON and Markdown table.
#   bash scripts/gpu_check.sh [OUT [bench gpu options, e.g. --sections speed]]   (default OUT: gpu_check/; $OUT when set)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_check}}"
if compgen -G ".gpu_wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target .gpu_site .gpu_wheels/*.whl
    export PYTHONPATH="$PWD/.gpu_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
python3 -c "from kava_ray.cli import main; raise SystemExit(main())" bench gpu --out "$out" --json "${@:2}" \
    | tee "$out.log"
echo "wrote $out/bench_gpu.json and $out/bench_gpu.md"
