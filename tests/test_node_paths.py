"""What a job reads from local paths on the nodes other than the driver's (kava_ray.runtime.node_paths), and the line a
user sees for each way a node's copy can be wrong. The check itself runs on a real three-node cluster in
tests/test_multinode.py (a driver whose files no node sees)."""

from kava_ray.common.config import resolve_paths, validate_config
from kava_ray.common.placement import Node
from kava_ray.core.plans import TeacherPlan
from kava_ray.runtime.node_paths import WORKERS, problem, reads, tokenizer_reads
from kava_ray.runtime.path_look import look


def _cfg(tmp_path, **data):
    teacher_dir = tmp_path / "teacher"
    teacher_dir.mkdir(parents=True)
    (teacher_dir / "config.json").write_text("{}")
    return resolve_paths(validate_config({
        "teachers": [{"name": "t", "model": str(teacher_dir), "label_selector": {"kava-role": "teacher"}},
                     {"name": "hub", "model": "Qwen/Qwen2.5-7B-Instruct"}],
        "student": {"model": str(tmp_path / "student")}, "data": data,
        "ray": {"storage_path": str(tmp_path / "runs"), "worker_label_selector": {"kava-role": "student"}}}))


def test_the_teachers_read_their_models_and_the_workers_read_the_jobs_inputs(tmp_path):
    cfg = _cfg(tmp_path, source=str(tmp_path / "{split}.jsonl"), val_split="validation")
    got = [(r.key, r.path.replace(str(tmp_path), "TMP"), r.who, r.demand.selector, r.writes)
           for r in reads(cfg, "train")]
    teacher, student = {"kava-role": "teacher"}, {"kava-role": "student"}
    assert got == [
        ("teachers[t].model", "TMP/teacher", "teacher 't'", teacher, False),  # a hub id is read from the hub
        ("student.model", "TMP/student", WORKERS, student, False),
        ("data.source", "TMP/train.jsonl", WORKERS, student, False),  # every split the run reads
        ("data.source", "TMP/validation.jsonl", WORKERS, student, False),
        ("data.source", "TMP/test.jsonl", WORKERS, student, False),
        ("ray.storage_path", "TMP/runs", WORKERS, student, True),
    ]
    assert [r.key for r in reads(cfg, "eval")] == ["teachers[t].model"]  # eval, precompute: the driver reads
    # once the teachers report their tokenizers: the workers load an aligned teacher's from its model path
    plans = {"t": TeacherPlan("t", None, None, [0], tokenizer=str(tmp_path / "teacher")),  # another tokenizer
             "hub": TeacherPlan("hub", None, None, [0])}
    assert [(r.key, r.who) for r in tokenizer_reads(cfg, plans)] == [("teachers[t].model",
                                                                      "the Ray Train workers (its tokenizer)")]
    cached = _cfg(tmp_path / "c", kv_source="cache", kv_cache_dir=str(tmp_path / "kv"))
    assert [r.key for r in reads(cached, "train")] == ["student.model", "data.kv_cache_dir", "ray.storage_path"]
    # a sweep's trials build their plans, with the layer map, wherever Tune puts them
    cka = cached.model_copy(update={"align": cached.align.model_copy(update={"layer_map": "cka",
                                                                             "cka_path": str(tmp_path / "cka.json")})})
    assert [(r.key, r.who, r.demand.resources) for r in reads(cka, "tune")][-1] == (
        "align.cka_path", "the Tune trials", {"CPU": 0.01})
    assert "align.cka_path" not in [r.key for r in reads(cka, "train")]  # train: read by the driver (preflight)


def test_what_a_node_sees_is_compared_with_what_the_driver_sees(tmp_path):
    """Missing, different content, or the same; a directory by the file its reader opens first."""
    cfg = _cfg(tmp_path, source=str(tmp_path / "qa.jsonl"))
    data = next(r for r in reads(cfg, "train") if r.key == "data.source")
    node = Node("abcdef0123456789", "10.0.1.7", {"CPU": 8, "GPU": 1}, name="")
    f = tmp_path / "qa.jsonl"
    assert look(str(f)) is None
    f.write_text('{"text": "a"}\n')
    here = look(str(f))
    assert problem(data, node, here, here) is None
    assert problem(data, node, None, here) == (
        f"data.source {f} is not on node abcdef01 (10.0.1.7: 8 CPU, 1 GPU), where the Ray Train workers read it: put "
        f"it on storage that every node mounts at the same path, or copy it there")
    f.write_text('{"text": "b"}\n')
    assert look(str(f)) != here  # same size, other content
    assert problem(data, node, look(str(f)), here).startswith(f"data.source {f} on node abcdef01 (10.0.1.7: 8 CPU, "
                                                               f"1 GPU) differs from the driver's")
    model = tmp_path / "teacher"
    before = look(str(model))
    assert before.startswith("config.json:")
    (model / "config.json").write_text('{"x": 1}')
    assert look(str(model)) != before
    assert look(str(tmp_path)) == "dir"


def test_a_teachers_model_need_only_be_on_the_nodes_that_load_it(tmp_path):
    """The driver (a CPU head) need not hold a teacher's weights: a node that has them passes, one that does not
    (or cannot read them) is named; their copies are compared with each other once loaded (identity check)."""
    cfg = _cfg(tmp_path, source="synthetic")
    model = next(r for r in reads(cfg, "train") if r.key == "teachers[t].model")
    node = Node("abcdef0123456789", "10.0.2.9", {"CPU": 8, "GPU": 8})
    assert not model.driver_reads
    assert problem(model, node, "config.json:1234", None) is None  # there, and not on the driver: fine
    assert problem(model, node, None, look(model.path)) == (
        f"teachers[t].model {model.path} is not on node abcdef01 (10.0.2.9: 8 CPU, 8 GPU), where teacher 't' read "
        f"it: put it on storage that every node mounts at the same path, or copy it there")
    assert problem(model, node, "unreadable (Permission denied)", None) == (
        f"teachers[t].model {model.path} on node abcdef01 (10.0.2.9: 8 CPU, 8 GPU) is unreadable (Permission "
        f"denied), where teacher 't' read it")


def test_a_split_sent_to_another_node_carries_its_rows_not_the_drivers_cache_files(tmp_path):
    """`teachers precompute`'s writer on a teacher's node gets the splits pickled: a Dataset read from the
    driver's Arrow cache would arrive as paths that node does not have."""
    import pickle
    import shutil

    from datasets import Dataset, load_from_disk

    from kava_ray.data.tokenize import TokenizedSplit, portable

    Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [1, 1]],
                       "length": [3, 2]}).save_to_disk(tmp_path / "arrow")
    split = TokenizedSplit(load_from_disk(str(tmp_path / "arrow")), "fp", 0, "text")
    assert split.dataset.cache_files  # backed by the driver's files
    moved = portable(split)
    assert moved.dataset.cache_files == [] and moved.fingerprint == "fp" and list(moved.lengths) == [3, 2]
    blob = pickle.dumps(moved)
    shutil.rmtree(tmp_path / "arrow")  # as on the other node
    again = pickle.loads(blob)
    assert [again.items[i]["input_ids"] for i in range(2)] == [[1, 2, 3], [4, 5]]
