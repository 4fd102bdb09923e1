"""`kava-ray bench gpu` at toy size on this machine: every section present, the CUDA-only ones marked as not run
with the reason, the ones that run on a CPU measured on the production step; and the whole run imports neither
Ray nor `datasets` (a GPU image may have neither: scripts/gpu_check.sh)."""

import json
import subprocess
import sys

import pytest
import torch

from kava_ray.bench.gpu import SECTIONS, format_gpu

pytestmark = pytest.mark.unit
CUDA_ONLY = ("correctness", "memory", "fits_8gb", "fsdp", "engines", "vllm_student", "lora", "url_teacher")


RUN = """
import json, sys
from kava_ray.bench.gpu import run_gpu_bench
run_gpu_bench(out=sys.argv[1], toy=True, steps=2)
print(json.dumps(sorted(m for m in ("ray", "datasets", "pyarrow") if m in sys.modules)))
"""


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One toy run in a fresh process (as scripts/gpu_check.sh runs it); (out dir, result, heavy modules loaded)."""
    out = tmp_path_factory.mktemp("bench-gpu")
    proc = subprocess.run([sys.executable, "-c", RUN, str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    return out, json.loads((out / "bench_gpu.json").read_text()), loaded


def test_every_section_is_there_and_cuda_only_ones_say_why(bench):
    out, r, _ = bench
    assert set(SECTIONS) <= set(r)
    if not torch.cuda.is_available():
        for name in CUDA_ONLY:
            assert "CUDA" in r[name]["not_run"], name
    text = (out / "bench_gpu.md").read_text()
    assert text.strip() == format_gpu(r).strip() and "not run" in text


def test_each_precision_policy_trains_the_student(bench):
    _, r, _ = bench
    for policy in ("fp32", "bf16-mixed"):
        p = r["precision"][policy]
        assert p["changed_share"] >= 0.99 and p["loss_last"] < p["loss_first"], (policy, p)
    sr = r["precision"]["bf16-sr"]
    assert "not_run" in sr or (sr["weight_dtype"] == "bfloat16" and sr["ok"]), sr


def test_speed_and_wire_are_measured(bench):
    _, r, _ = bench
    kinds = {row["what"].split(" (")[0] for row in r["speed"]["rows"]}
    assert kinds == {"teacher forward + KV", "student step"}
    for row in r["speed"]["rows"]:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1, row
    for wire in ("bf16", "fp8"):
        assert r["wire"][wire]["encode_gb_s"] > 0 and r["wire"][wire]["decode_gb_s"] > 0


def test_the_run_imports_neither_ray_nor_datasets(bench):
    assert bench[2] == []


def test_the_chunked_loss_section_equals_whole_logits(bench):
    """CE and logit KD from chunks of the vocabulary: the same first loss as whole logits (fp32 on a CPU, toy
    sizes); on CUDA the section adds the peak memory of each."""
    _, r, _ = bench
    rows = r["chunked_loss"]["rows"]
    assert [x["recipe"] for x in rows] == ["ce", "ce+logits"]
    for x in rows:
        assert x["loss_rel_diff"] < 1e-5 and x["time_ratio"] > 0, x
        assert (x["memory_ratio"] is None) == (not torch.cuda.is_available())


def test_sections_runs_only_those_named_and_refuses_an_unknown_one(tmp_path):
    """`--sections` (a rerun of what failed on a lent GPU, inside its time limit): the others say why they did not
    run; a misspelt section is refused before anything runs."""
    from kava_ray.bench.gpu import run_gpu_bench
    from kava_ray.common.errors import KavaError

    r = run_gpu_bench(out=str(tmp_path), toy=True, steps=1, sections=["wire"])
    assert "bf16" in r["wire"] and all(r[s] == {"not_run": "not selected (--sections)"}
                                       for s in SECTIONS[1:] if s != "wire")
    assert json.loads((tmp_path / "bench_gpu.json").read_text())["wire"] == r["wire"]
    with pytest.raises(KavaError, match="unknown section.*wires"):
        run_gpu_bench(toy=True, sections=["wires"])
