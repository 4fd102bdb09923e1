"""The projector-free KV alignment figure (`kava_ray.core.probe`): a student equal to its teacher's kept layers
scores 1, a random student ~0, directly and through the linear probe."""

import pytest
import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.kv import student_forward_kv, teacher_forward_kv
from kava_ray.core.models import load_model, load_student
from kava_ray.core.probe import KVAlignment, source_layers
from tiny_models import build_tiny_model

pytestmark = pytest.mark.unit

KEEP = [0, 2, 3]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A 5-layer teacher whose layers 1 and 4 add nothing to the residual stream (zero output projections):
    its layers 0, 2, 3 kept, in that order, make a student with exactly the teacher's K and V there. And a
    random student of the same 3-layer shape."""
    root = tmp_path_factory.mktemp("probe")
    path = build_tiny_model(root / "teacher", family="llama", num_layers=5, hidden_size=32, num_heads=4,
                            num_kv_heads=2, seed=3)
    teacher = load_model(path, dtype="float32")
    with torch.no_grad():
        for i in (1, 4):
            layer = teacher.model.layers[i]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    teacher.save_pretrained(path)
    random_path = build_tiny_model(root / "random", family="llama", num_layers=3, hidden_size=32, num_heads=4,
                                   num_kv_heads=2, seed=11)
    return (load_model(path, dtype="float32"), load_student(path, dtype="float32", keep=KEEP).eval(),
            load_model(random_path, dtype="float32"))


def batches(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 256, (3, 20), generator=g)
        mask = torch.ones(3, 20, dtype=torch.long)
        mask[1, -5:] = 0
        yield ids, mask


def kv_pair(teacher, student, ids, mask):
    t = teacher_forward_kv(teacher, ids, mask, layers=KEEP)
    with torch.no_grad():
        _, s = student_forward_kv(student, ids, mask)
    return (s.keys, s.values), (t.keys, t.values)


def score(teacher, student, probe: bool) -> dict:
    kva = KVAlignment(list(range(len(KEEP))), probe=probe)
    if probe:
        for ids, mask in batches(6, seed=1):  # "training split"
            kva.fit_batch(*kv_pair(teacher, student, ids, mask), mask)
        kva.fit()
    for ids, mask in batches(3, seed=2):  # "test split"
        kva.score_batch(*kv_pair(teacher, student, ids, mask), mask)
    return kva.result()


def test_a_student_of_the_kept_layers_scores_one_and_a_random_student_zero(models):
    teacher, copied, random = models
    assert source_layers(KEEP, 3, 5) == KEEP
    exact = score(teacher, copied, probe=False)
    assert exact["kv_cos_free"] == pytest.approx(1.0, abs=1e-5) and exact["tokens"] == 3 * (3 * 20 - 5)
    assert exact["method"].startswith("direct")
    noise = score(teacher, random, probe=False)
    assert abs(noise["kv_cos_free"]) < 0.1, noise
    # the linear probe, fit on other batches: ~1 for the copy (a linear map exists), far lower for noise
    assert score(teacher, copied, probe=True)["kv_cos_free"] > 0.99
    assert score(teacher, random, probe=True)["kv_cos_free"] < 0.9


def test_geometry_and_layer_checks_are_one_line(models):
    teacher, copied, _ = models
    with pytest.raises(KavaError, match="keep_layers"):
        source_layers([0, 9], 2, 5)
    (s, t), mask = kv_pair(teacher, copied, *next(batches(1, 0))), next(batches(1, 0))[1]
    with pytest.raises(KavaError, match="pairs"):
        KVAlignment([0, 1]).score_batch(s, t, mask)
    with pytest.raises(KavaError, match="fit"):
        KVAlignment([0, 1, 2], probe=True).score_batch(s, t, mask)
