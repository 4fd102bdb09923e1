"""Preflight (`kava_ray.runtime.preflight`): every bad input of a Ray-starting command is one `error:` line, exit 2,
in well under 5 s, before Ray starts or any teacher loads.

Each case runs the real CLI in process (`kava_ray.cli.main`, what the console script calls) on the tiny job;
one test runs the installed `kava-ray train` to time the whole command (imports + preflight).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kava_ray.cli import main

pytestmark = pytest.mark.unit
MAX_S = 5.0


@pytest.fixture
def no_start(monkeypatch):
    """Record (and refuse) any attempt to connect to Ray or start a teacher pool."""
    import ray

    import actors.pool
    import kava_ray.runtime.job

    calls = []

    def refuse(name):
        def f(*a, **k):
            calls.append(name)
            raise AssertionError(f"{name} called: preflight should have failed first")
        return f

    monkeypatch.setattr(kava_ray.runtime.job, "connect_job", refuse("connect_job"))
    monkeypatch.setattr(actors.pool, "start_pool", refuse("start_pool"))
    monkeypatch.setattr(ray, "init", refuse("ray.init"))  # the test session's own Ray may already be up
    return calls


@pytest.fixture
def run_cli(capsys, no_start):
    """`kava-ray ARGS` in this process -> .returncode, .stdout, .stderr, .wall_s; checks Ray stayed down."""
    import ray

    was_up = ray.is_initialized()

    def run(*args):
        capsys.readouterr()
        t0 = time.perf_counter()
        code = main([str(a) for a in args])
        wall = time.perf_counter() - t0
        out = capsys.readouterr()
        assert ray.is_initialized() == was_up, "preflight let Ray start"
        assert no_start == [], f"started before failing: {no_start}"
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err, wall_s=wall)
    return run


def assert_one_line(r, *needles):
    """Exit 2, one `error:` line on stderr naming every needle, no traceback, under MAX_S."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])
    assert r.wall_s < MAX_S, f"{r.wall_s:.2f} s: {lines[0]}"


def train(run_cli, tiny_job, *overrides, extra=()):
    return run_cli("train", "--config", tiny_job, *extra, *overrides)


# ------------------------------------------------------------------------------------------- data


def test_missing_data_file(run_cli, tiny_job, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert_one_line(train(run_cli, tiny_job, "data.source=data/trian.jsonl"), "data.source", "data/trian.jsonl",
                    "not found")


def test_typo_of_synthetic(run_cli, tiny_job):
    assert_one_line(train(run_cli, tiny_job, "data.source=synthetc"), "data.source", "synthetc")


def test_misspelt_path_without_extension_next_to_a_local_dir(run_cli, tiny_job, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert_one_line(train(run_cli, tiny_job, "data.source=data/trian"), "data/trian", "local directory")


def test_empty_jsonl(run_cli, tiny_job, tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("")
    assert_one_line(train(run_cli, tiny_job, f"data.source={f}"), str(f), "empty")


def test_malformed_jsonl_names_the_line(run_cli, tiny_job, tmp_path):
    f = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "1+1?", "answer": "#### 2"})
    f.write_text(f"{good}\n{good}\n{{\"question\": \"3+3?\", \"answer\": \n{good}\n")
    assert_one_line(train(run_cli, tiny_job, f"data.source={f}"), str(f), "line 3", "not valid JSON")


def test_jsonl_without_the_fields(run_cli, tiny_job, tmp_path):
    f = tmp_path / "fields.jsonl"
    f.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    assert_one_line(train(run_cli, tiny_job, f"data.source={f}"), str(f), "line 1", "no known format", "(it has: q, a)",
                    "question+answer", "data.columns")
    # named by the format: the missing field
    assert_one_line(train(run_cli, tiny_job, f"data.source={f}", "data.format=gsm8k"), str(f), "no 'question' field")


CHAT_OK = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}


@pytest.mark.parametrize("rows,needles", [
    ([CHAT_OK, {"messages": [{"role": "user", "content": "hi"}]}], ["line 2 (row 1)", "no assistant turn"]),
    ([CHAT_OK, {"text": "plain prose"}], ["line 2 (row 1)", "is a text record, but", "is messages"]),
    ([{"messages": [{"role": "robot", "content": "x"}]}], ["line 1 (row 0)", "message 0 needs a role"]),
    ([{"prompt": "p"}], ["line 1 (row 0)", "no known format", "(it has: prompt)"]),
], ids=["no-assistant", "mixed", "bad-role", "half-a-pair"])
def test_bad_record_formats_are_one_line_naming_file_and_row(run_cli, tiny_job, tmp_path, rows, needles):
    f = tmp_path / "records.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert_one_line(train(run_cli, tiny_job, f"data.source={f}"), str(f), *needles)


def test_renamed_columns_are_checked(run_cli, tiny_job, tmp_path):
    f = tmp_path / "alpaca.jsonl"
    f.write_text(json.dumps({"instruction": "Say hi", "output": "hi"}) + "\n")
    assert_one_line(train(run_cli, tiny_job, f"data.source={f}"), "no known format", "instruction, output")
    r = train(run_cli, tiny_job, f"data.source={f}", "data.columns={prompt: instruction, completion: outptu}")
    assert_one_line(r, "data.columns", "'outptu' is not in data file", "instruction, output")
    assert_one_line(train(run_cli, tiny_job, f"data.source={f}", "data.columns={prompt: instruction, answr: output}"),
                    "data.columns", "'answr' is not a record field")


def test_bad_test_split_fails_before_training(run_cli, tiny_job, tmp_path):
    """`{split}` paths: the test split is read only at the end of a run, so preflight checks it first."""
    good = json.dumps({"question": "1+1?", "answer": "#### 2"})
    (tmp_path / "train.jsonl").write_text("\n".join([good] * 20) + "\n")
    r = train(run_cli, tiny_job, f"data.source={tmp_path}/{{split}}.jsonl")
    assert_one_line(r, str(tmp_path / "test.jsonl"), "not found")


# ------------------------------------------------------------------------------------- output, resume


def test_unwritable_storage_path(run_cli, tiny_job, tmp_path):
    if os.geteuid() == 0:  # root writes through chmod 0o500: a path under an existing *file* instead
        parent = tmp_path / "a-file"
        parent.write_text("")
        storage = parent / "runs"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        storage = ro / "runs"
    try:
        assert_one_line(train(run_cli, tiny_job, f"ray.storage_path={storage}"), "ray.storage_path", str(storage))
    finally:
        if os.geteuid() != 0:
            (tmp_path / "ro").chmod(0o700)


@pytest.mark.parametrize("text", ['{"step": 2, "config_hash": "ab', "not json at all", ""])
def test_resume_with_corrupt_state_json(run_cli, tiny_job, tmp_path, text):
    ckpt = tmp_path / "run" / "checkpoint_2024-01-01_00-00-00.000000"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(text)
    r = train(run_cli, tiny_job, extra=("--resume", tmp_path / "run"))
    assert_one_line(r, str(ckpt / "state.json"))


def test_resume_of_a_missing_run(run_cli, tiny_job, tmp_path):
    assert_one_line(train(run_cli, tiny_job, extra=("--resume", tmp_path / "nope")), str(tmp_path / "nope"))


# ------------------------------------------------------------------------------------ layer map, models


def test_cka_layer_map_without_its_file(run_cli, tiny_job):
    r = train(run_cli, tiny_job, "align.layer_map=cka", "align.cka_path=/nope.json")
    assert_one_line(r, "align.cka_path", "/nope.json")


def test_student_dir_without_config_json(run_cli, tiny_job, tmp_path, tiny_student_dir):
    student = tmp_path / "student"
    shutil.copytree(tiny_student_dir, student)
    (student / "config.json").unlink()
    assert_one_line(train(run_cli, tiny_job, f"student.model={student}"), "student.model", str(student),
                    "config.json")


def test_missing_teacher_gguf(run_cli, tiny_job, tmp_path):
    r = train(run_cli, tiny_job, f"teachers.0.model={tmp_path}/teacher.gguf")
    assert_one_line(r, "teachers[qwen].model", "teacher.gguf")


def test_uninstalled_pypi_teacher(run_cli, tiny_job):
    r = train(run_cli, tiny_job, "teachers.1.model=pypi://no-such-dist-kava/model.gguf")
    assert_one_line(r, "teachers[llama].model", "pip install")


# -------------------------------------------------------------------------------- the other commands


def test_every_ray_command_runs_preflight(run_cli, tiny_job, tmp_path):
    bad = "data.source=synthetc"
    assert_one_line(run_cli("tune", "--config", tiny_job, "--space", "default", bad), "synthetc")
    assert_one_line(run_cli("align", "cka", "--config", tiny_job, "--samples", 4, bad), "synthetc")
    assert_one_line(run_cli("demo", bad), "synthetc")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "state.json").write_text("{")
    assert_one_line(run_cli("eval", ckpt), str(ckpt / "state.json"))


def test_precompute_runs_preflight_before_teachers(tiny_job, tmp_path, no_start):
    """`job.precompute` itself (the CLI's `teachers precompute` connects to Ray before calling it: see
    kava_ray.cli.teachers), so here the function, not the command."""

    from kava_ray.common.config import load_config
    from kava_ray.common.errors import KavaError
    from kava_ray.runtime.job import precompute

    t0 = time.perf_counter()
    with pytest.raises(KavaError) as e:
        precompute(load_config(str(tiny_job), ["data.source=synthetc"]), tmp_path / "cache")
    assert "synthetc" in str(e.value) and "\n" not in str(e.value)
    assert time.perf_counter() - t0 < MAX_S and no_start == []
    parent = tmp_path / "a-file"
    parent.write_text("")
    with pytest.raises(KavaError) as e:
        precompute(load_config(str(tiny_job)), parent / "cache")
    assert str(e.value).startswith("--out=") and "a-file" in str(e.value)


def test_tune_space_is_checked_first(run_cli, tiny_job):
    r = run_cli("tune", "--config", tiny_job, "--space", "no-such-space", "data.source=synthetc")
    assert_one_line(r, "no-such-space")


def test_a_good_config_passes(tiny_job):
    from kava_ray.common.config import load_config
    from kava_ray.runtime.preflight import preflight

    t0 = time.perf_counter()
    preflight(load_config(str(tiny_job)), "train")
    assert time.perf_counter() - t0 < MAX_S


# ------------------------------------------------------------------------------------ the whole command


def test_installed_train_with_a_bad_source_fails_in_one_line_fast(tiny_job):
    exe = shutil.which("kava-ray", path=str(Path(sys.executable).parent))
    assert exe, "the kava-ray console script is not installed next to this Python"
    t0 = time.perf_counter()
    r = subprocess.run([exe, "train", "--config", str(tiny_job), "data.source=data/trian.jsonl"],
                       capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - t0
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "data/trian.jsonl" in lines[0], r.stderr
    assert wall < 10, f"{wall:.1f} s"


def test_tune_resume_checks_the_sweep(run_cli, tiny_job, tmp_path):
    assert_one_line(run_cli("tune", "--config", tiny_job, "--space", "default", "--resume", tmp_path / "nope"),
                    str(tmp_path / "nope"), "nothing to resume")
    state = tmp_path / "sweep" / "trial_0" / "run" / "checkpoint_2024-01-01_00-00-00.000000" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text('{"step": 1, "con')
    assert_one_line(run_cli("tune", "--config", tiny_job, "--space", "default", "--resume", tmp_path / "sweep"),
                    str(state))


def test_a_hub_id_is_left_to_the_loader():
    """`org/name` passes (whether the hub has it needs the network: the loader's one line); a bare word does not."""
    from kava_ray.common.errors import KavaError
    from kava_ray.data.sources import check_source

    check_source("openai/gsm8k", "train")
    with pytest.raises(KavaError, match="gsm8k"):
        check_source("gsm8k", "train")


def test_an_address_no_resolver_takes_is_unreachable_not_a_traceback():
    """A mangled --address (a quote, an empty label) makes getaddrinfo raise UnicodeError, not OSError: the probe
    says "nothing answers" (one line, exit 2) instead of crashing."""
    from kava_ray.runtime.connect import answers

    assert answers("'19.0..:6399", timeout_s=0.5) is False
    assert answers("127.0.0.1:notaport") is False


@pytest.mark.parametrize("alive", [False, True], ids=["stale-address-file", "running-head"])
def test_an_embedded_ray_is_its_own_beside_ray_s_address_file(tmp_path, monkeypatch, capsys, alive):
    """Without --address, `connect` starts a Ray of its own (`ray.init(address="local")`, on 127.0.0.1) whatever Ray's
    address file names: the stale file of a killed head silently, a running head with one note line (what
    tests/test_service_ray.py's `kava-ray train` beside a live head shows end to end). ray.init is recorded, not
    run: the decision is kava-ray's, the rest Ray's."""
    import ray

    import kava_ray.runtime.connect as connect

    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(connect, "answers", lambda address, timeout_s=0: alive and address == "127.0.0.1:1")
    monkeypatch.setattr(connect, "single_machine_mode", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    for var in ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT"):
        monkeypatch.setenv(var, "0")  # connect sets them; monkeypatch puts them back
    assert connect.connect(None, "ns", num_cpus=2) == "embedded"
    (kw,) = calls
    assert kw["address"] == "local" and kw["_node_ip_address"] == "127.0.0.1" and kw["num_cpus"] == 2
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == ([] if not alive else ["note: a Ray cluster is running on this machine (127.0.0.1:1); kava-ray "
                                           "uses its own embedded Ray unless you pass --address auto"])


def test_address_auto_reads_ray_s_address_file_and_says_so_when_there_is_none(tmp_path, monkeypatch):
    """`--address auto`: $RAY_ADDRESS, else the last `ray start --head`'s GCS address from Ray's address file
    (`<RAY_TMPDIR>/ray/ray_current_cluster`); no file is one line naming the fix."""
    from kava_ray.common.errors import KavaError
    from kava_ray.runtime.connect import _resolve_auto

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(KavaError, match=r"--address auto: no running Ray cluster on this machine \(start one with "
                                        r"`ray start --head`") as info:
        _resolve_auto()
    assert "\n" not in str(info.value)
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6380\n")
    assert _resolve_auto() == "127.0.0.1:6380"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert _resolve_auto() == "10.0.0.5:6379"


# ------------------------------------------------- what cannot train is refused before anything starts (issue 42)
# Each: exit 2, one `error:` line, Ray never started, and nothing written under ray.storage_path (no run dir).


def refused(run_cli, job, *args, needles=(), command="train", storage=None):
    """`kava-ray COMMAND --config JOB ARGS` refused in one line naming `needles`, leaving no run dir behind."""
    from kava_ray.common.config import load_config

    storage = Path(storage or load_config(str(job)).ray.storage_path)
    before = sorted(p.name for p in storage.iterdir()) if storage.is_dir() else []
    r = run_cli(command, "--config", job, *args)
    assert_one_line(r, *needles)
    after = sorted(p.name for p in storage.iterdir()) if storage.is_dir() else []
    assert after == before, f"written on refusal: {sorted(set(after) - set(before))}"
    return r.stderr.strip()


def qa_rows(n, prompt=lambda i: f"question {i}?", completion=lambda i: f" answer {i}."):
    return "\n".join(json.dumps({"prompt": prompt(i), "completion": completion(i)}) for i in range(n)) + "\n"


def test_on_policy_text_records_are_one_line_wherever_their_format_is_known(run_cli, tiny_job, tmp_path):
    """On-policy distillation samples a completion for each record's prompt, and text records have none: the same
    line (`preflight.check_prompts`, its one home) from data.format alone (a hub id, never read), from a local file
    read at preflight, and from data prep (`recipes.train._data`: where a hub dataset of format auto is known)."""
    from kava_ray.common.config import load_config
    from kava_ray.common.errors import KavaError
    from kava_ray.recipes.train import _data

    f = tmp_path / "prose.jsonl"
    f.write_text("".join(json.dumps({"text": f"plain prose, line {i}: " + "words " * 30}) + "\n" for i in range(60)))
    line = ("onpolicy.fraction=1.0: data.source {} holds text records, which have no prompt to sample a completion "
            "for (on-policy distillation needs prompt_completion, messages or gsm8k records)")
    storage = tmp_path / "runs"
    for source, extra in ((f, []), ("org/prose", ["data.format=text"])):
        r = refused(run_cli, tiny_job, "onpolicy.fraction=1", f"data.source={source}", *extra,
                    f"ray.storage_path={storage}", storage=storage)
        assert r == "error: " + line.format(source)
    with pytest.raises(KavaError) as e:
        _data(load_config(str(tiny_job), ["onpolicy.fraction=1", f"data.source={f}"]))
    assert str(e.value) == line.format(f)


def test_a_jsonl_cut_mid_line_names_the_broken_line(run_cli, tiny_job, tmp_path):
    """A line cut short deep in the file (past the records preflight reads first) or at its end: the cause, a
    broken line, and its number (not the Arrow reader's "cannot read it as a table")."""
    rows = qa_rows(40).splitlines()
    f = tmp_path / "cut.jsonl"
    f.write_text("\n".join([*rows[:30], rows[30][:12], *rows[31:]]) + "\n")
    refused(run_cli, tiny_job, f"data.source={f}", needles=(str(f), "line 31 is broken, not valid JSON",
                                                            "column 13"))
    f.write_text("\n".join(rows) + "\n" + rows[0][:15])  # a download or a copy stopped mid-line
    refused(run_cli, tiny_job, f"data.source={f}", needles=(str(f), "line 41 is broken, not valid JSON"))


def test_held_out_rows_that_are_training_rows_are_refused(run_cli, tiny_job, tmp_path):
    """Separate files that share records: the held-out figures would be training figures."""
    (tmp_path / "train.jsonl").write_text(qa_rows(40))
    (tmp_path / "test.jsonl").write_text(qa_rows(8))  # the first 8 training records again
    refused(run_cli, tiny_job, f"data.source={tmp_path}/{{split}}.jsonl", "data.format=prompt_completion",
            needles=("8 of 8 test records are also training records", "data.allow_overlap: true"))


def test_one_file_is_carved_into_disjoint_splits_and_overlap_is_allowed_only_when_asked(tiny_job, tmp_path, capsys):
    """One file for every split (no {split}): validation and test are cut from its end, disjoint from training;
    data.allow_overlap: true reads the file for every split, with a warning line."""
    from kava_ray.common.config import load_config
    from kava_ray.common.errors import KavaError
    from kava_ray.core.models import load_tokenizer
    from kava_ray.data.splits import carved, check_overlap, load_splits, load_test_split
    from kava_ray.runtime.preflight import prepare_data

    (tmp_path / "chat.jsonl").write_text(qa_rows(120))
    cfg = load_config(str(tiny_job), [f"data.source={tmp_path}/chat.jsonl", "data.num_train=null"])
    tok = load_tokenizer(cfg.student.model)
    train, val = load_splits(cfg.data, cfg.train, tok)
    test = load_test_split(cfg.data, cfg.train, tok)
    assert carved(cfg.data) and (len(train), len(val), len(test)) == (120 - 16, 8, 8)
    texts = lambda s: {tuple(s.items[i]["input_ids"]) for i in range(len(s))}  # noqa: E731
    assert not texts(train) & texts(test) and not texts(train) & texts(val) and not texts(val) & texts(test)
    assert prepare_data(cfg)["carved"] and check_overlap(cfg.data) is None
    allowed = load_config(str(tiny_job), [f"data.source={tmp_path}/chat.jsonl", "data.allow_overlap=true"])
    assert not carved(allowed.data)
    assert check_overlap(allowed.data) == ("warning: data.allow_overlap: 8 of 8 test records are also training records "
                                      "(every split reads the same file): they are not held out")
    # null numbers (every record of a split's own file): 5 % of the one file each, at least one
    nulls = ["data.num_val=null", "data.num_test=null", "data.val_split=validation"]
    shares = load_config(str(tiny_job), [f"data.source={tmp_path}/chat.jsonl", "data.num_train=null", *nulls])
    assert {k: prepare_data(shares)[k] for k in ("train", "validation", "test")} == {"train": 108, "validation": 6,
                                                                                     "test": 6}
    (tmp_path / "two.jsonl").write_text(qa_rows(2))
    with pytest.raises(KavaError, match=r"has 2 records: too few to carve 1 validation \(data.num_val\) and 1 test"):
        prepare_data(load_config(str(tiny_job), [f"data.source={tmp_path}/two.jsonl", "data.num_val=1", *nulls[1:]]))


def test_null_shares_are_of_the_records_the_job_trains_on(tiny_job, tmp_path):
    """A null num_val / num_test is 5 % of `num_train` when it is set (at least one), not of the whole file (100 of
    a million records: 5 validation rows, not 50,000); without val_split on a `{split}` source or a one-file source
    with allow_overlap, a null num_val is that share of the training records too (no config error, no TypeError)."""
    from kava_ray.common.config import load_config
    from kava_ray.data.splits import carved_counts
    from kava_ray.runtime.preflight import prepare_data

    (tmp_path / "chat.jsonl").write_text(qa_rows(400))
    one = [f"data.source={tmp_path}/chat.jsonl", "data.num_val=null", "data.num_test=null"]
    cfg = load_config(str(tiny_job), [*one, "data.num_train=40"])
    assert carved_counts(cfg.data, 1_000_000) == (2, 2) and carved_counts(cfg.data, 10) == (1, 1)
    every = load_config(str(tiny_job), one + ["data.num_train=null"])
    assert carved_counts(every.data, 1_000_000) == (50_000, 50_000)
    assert {k: prepare_data(cfg)[k] for k in ("train", "validation", "test")} == {"train": 40, "validation": 2,
                                                                                  "test": 2}
    (tmp_path / "train.jsonl").write_text(qa_rows(400))
    (tmp_path / "test.jsonl").write_text(qa_rows(3, prompt=lambda i: f"held out {i}?"))
    split = load_config(str(tiny_job), [f"data.source={tmp_path}/{{split}}.jsonl", "data.num_val=null",
                                        "data.num_train=100"])
    assert split.data.val_split is None
    assert {k: prepare_data(split)[k] for k in ("train", "validation", "test")} == {"train": 100, "validation": 5,
                                                                                    "test": 3}
    overlap = load_config(str(tiny_job), [*one, "data.num_train=null", "data.allow_overlap=true"])
    assert {k: prepare_data(overlap)[k] for k in ("train", "validation", "test")} == {"train": 380,
                                                                                      "validation": 20, "test": 400}


@pytest.fixture(scope="module")
def smol_job(tmp_path_factory, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir, smol_teacher_dir):
    """Teachers `qwen` (the student's tokenizer) and `smol` (SmolLM2's: another tokenizer)."""
    from jobs import write_job

    return write_job(tmp_path_factory.mktemp("smoljob"), tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"},
                               {"name": "smol", "model": str(smol_teacher_dir), "dtype": "float32"}])


def test_a_record_naming_no_logit_teacher_is_refused_before_ray(run_cli, tiny_job, smol_job, tmp_path):
    """Records that name their teacher (column `teacher`) were checked by the Distiller, 45 s in (Ray and the teachers
    up): a name that is no logit teacher of the job -- unknown, or one of another tokenizer with
    logit_cross_vocab=off -- is now one line from the data stage, past the first records preflight parses."""
    rows = [{"prompt": f"question {i}?", "completion": f" answer {i}.", "teacher": ("qwen", "llama")[i % 2]}
            for i in range(48)]
    rows[20]["teacher"] = "gpt4"
    (tmp_path / "routed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    refused(run_cli, tiny_job, f"data.source={tmp_path}/routed.jsonl", "loss.logit_weight=1",
            needles=(f"data.source {tmp_path}/routed.jsonl: row 20 of the training split names teacher 'gpt4' "
                     f"(column 'teacher'), but the job's logit teachers are qwen, llama",))
    for r in rows:
        r["teacher"] = r["teacher"].replace("llama", "smol").replace("gpt4", "qwen")
    (tmp_path / "routed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    refused(run_cli, smol_job, f"data.source={tmp_path}/routed.jsonl", "loss.logit_weight=1",
            "loss.logit_cross_vocab=off",
            needles=("row 1 of the training split names teacher 'smol'", "logit teachers are qwen ('smol' uses "
                     "another tokenizer than the student's and loss.logit_cross_vocab=off)"))


def test_a_completion_writer_of_another_tokenizer_is_refused_before_ray(run_cli, smol_job):
    """`onpolicy.source: teacher` with a writer of another tokenizer was refused once the teachers had reported their
    tokenizers (45-49 s in); its tokenizer is read here, before Ray. One of the student's tokenizer passes."""
    from kava_ray.common.config import load_config
    from kava_ray.runtime.preflight import preflight

    on = ["onpolicy.fraction=1", "onpolicy.source=teacher", "loss.logit_weight=1"]
    refused(run_cli, smol_job, *on, "onpolicy.teacher=smol",
            needles=("onpolicy.source: teacher needs a teacher of the student's tokenizer; 'smol' has another",))
    preflight(load_config(str(smol_job), [*on, "onpolicy.teacher=qwen"]), "train")


@pytest.mark.parametrize("kind", ["prompt-longer-than-max-length", "empty-completions"])
def test_a_split_without_a_loss_token_is_refused_naming_why(run_cli, tiny_job, tmp_path, kind):
    rows = (qa_rows(40, prompt=lambda i: f"{i} " + "many words " * 200) if kind.startswith("prompt") else
            "\n".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"},
                                               {"role": "assistant", "content": ""}]}) for i in range(40)))
    (tmp_path / "qa.jsonl").write_text(rows)
    why = ("with a prompt of train.max_length=288 tokens or more" if kind.startswith("prompt")
           else "with an empty completion / assistant turn")
    refused(run_cli, tiny_job, f"data.source={tmp_path}/qa.jsonl", needles=("no token carries loss", "24 records",
                                                                            f"24 {why}"))


@pytest.mark.parametrize("override,needles", [
    ("loss.kv_weight=inf", ("config key 'loss.kv_weight'", "finite number")),
    ("optim.lr_student=nan", ("config key 'optim.lr_student'", "finite number")),
    ("student.keep_layers=[]", ("student.keep_layers", "at least one layer")),
    ("student.keep_layers=[1, 0]", ("student.keep_layers", "strictly increasing", "did you mean [0, 1]")),
    ("student.keep_layers=[0, 9]", ("student.keep_layers", "[0, 1]")),  # the tiny student has 2 layers
    ("teachers.0.layers=[0, 40]", ("teachers[qwen].layers", "layer 40 is out of range")),
    ("train.batch_size=100", ("train.batch_size=100", "has 64 rows", "fewer than one batch")),
], ids=["kv-weight-inf", "lr-nan", "keep-none", "keep-reordered", "keep-past-depth", "teacher-layer-past-depth",
        "batch-above-examples"])
def test_what_cannot_train_is_one_line(run_cli, tiny_job, override, needles):
    refused(run_cli, tiny_job, override, needles=needles)


@pytest.mark.parametrize("overrides,needles", [
    (["onpolicy.fraction=0.5", "onpolicy.max_new_tokens=100000"],
     ("config key 'onpolicy.max_new_tokens'", "100000 must be below train.max_length (288)")),
    (["ray.strategy=fsdp"], ("config key 'ray.strategy'", "ray.num_workers is 1", "it would train unsharded")),
    (["train.max_length=1000000"], ("train.max_length=1000000 is past the context of student.model",
                                    "512 positions", "max_position_embeddings")),
], ids=["max-new-tokens-past-max-length", "fsdp-one-worker", "max-length-past-context"])
def test_a_length_or_strategy_the_job_cannot_have_is_one_line(run_cli, tiny_job, overrides, needles):
    """Sampling past train.max_length (it hung), FSDP with nothing to shard over (it ran unsharded), rows longer
    than the student's context (it was refused with a RAM figure)."""
    refused(run_cli, tiny_job, *overrides, needles=needles)


def test_weights_cut_short_or_not_safetensors_are_named_before_ray(run_cli, tiny_job, tmp_path,
                                                                     tiny_student_dir):
    student = tmp_path / "student"
    shutil.copytree(tiny_student_dir, student)
    weights = student / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a download cut short
    refused(run_cli, tiny_job, f"student.model={student}", needles=(str(weights), "cut short"))
    weights.write_bytes(b"\x00" * 64)  # not safetensors at all
    refused(run_cli, tiny_job, f"student.model={student}", needles=(str(weights), "not a readable safetensors"))


def test_a_step_that_cannot_fit_this_machine_is_refused(run_cli, tiny_job, monkeypatch):
    """The planner's memory of one step against the RAM this machine has free (on a GPU: its memory)."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2**20))
    refused(run_cli, tiny_job, needles=("GiB of RAM", "this machine has 0.0 GiB available", "kava-ray plan"))


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "my run", "a;b"])
def test_a_run_name_is_one_directory(run_cli, tiny_job, name):
    refused(run_cli, tiny_job, "--name", name, needles=(f"--name {name!r}", "one directory under ray.storage_path",
                                                        "letters, digits, '-', '_', '.'"))


def test_a_job_name_is_held_to_the_same_rule(run_cli, tiny_job):
    """The config's `name` names the run dirs (`<name>-<time>`) when `--name` is not given: the same rule."""
    refused(run_cli, tiny_job, "name=my run", needles=("config key 'name'", "' ' is not allowed",
                                                       "one directory under ray.storage_path"))


def test_a_run_name_of_any_letters_and_digits_passes():
    """The rule the refusal states, and no more: Unicode letters and digits, `-`, `_`, `.`."""
    from kava_ray.runtime.preflight import check_name

    for name in ("modèle-v1", "run_2.b", "实验٣"):
        check_name(name)


def test_options_between_overrides(run_cli, tiny_job, tmp_path):
    """`kava-ray train --config J KEY=VALUE --name N KEY=VALUE --verbose`: an override after an option is read
    (argparse's intermixed parsing) and refused on its own terms, not as an unrecognized argument."""
    missing = tmp_path / "missing.jsonl"
    refused(run_cli, tiny_job, "train.steps=2", "--name", "x", f"data.source={missing}", "--verbose",
            needles=(str(missing), "not found"))


@pytest.mark.parametrize("space,needles", [
    ({"params": {"teachers.0.model": {"choice": ["a", "b"]}}}, ("'teachers.0.model': not searchable",)),
    ({"metric": "eval/cee", "params": {"loss.beta": {"choice": [0.0, 0.1]}}}, ("did you mean 'eval/ce'",)),
    ({"params": {"train.batch_size": {"uniform": [2, 8]}}}, ("'train.batch_size': an integer key",)),
], ids=["teacher-key", "metric-typo", "fraction-over-int"])
def test_a_search_space_a_sweep_cannot_apply_is_refused(run_cli, tiny_job, tmp_path, space, needles):
    import yaml

    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    refused(run_cli, tiny_job, "--space", path, command="tune", needles=needles)


def test_an_address_that_is_not_ray_fails_fast_naming_where_it_came_from(tiny_job, monkeypatch, capsys):
    """An HTTP server (the dashboard's port) and a port that accepts and never answers: one line within ~3 s each
    (ray.init would wait minutes there), $RAY_ADDRESS named when it is where the address came from; `train`'s line
    names no logs dir its refusal removed."""
    import http.server
    import socket
    import threading

    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init reached with an address that is not Ray"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # the test session's own Ray may be up in this process
    http_server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)

    def run(*args):
        t0 = time.perf_counter()
        code = main([str(a) for a in args])
        return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err, wall_s=time.perf_counter() - t0)

    try:
        http_addr = f"127.0.0.1:{http_server.server_address[1]}"
        silent_addr = f"127.0.0.1:{silent.getsockname()[1]}"
        assert_one_line(run("teachers", "status", "--config", tiny_job, "--address", http_addr),
                        f"cannot connect to Ray at '{http_addr}'", "an HTTP server", "not a Ray cluster")
        # train names its run dir before Ray starts and removes it on a refusal: the line names no logs dir (it
        # pointed at RUN_DIR/logs, gone), and nothing is left under ray.storage_path
        from kava_ray.common.config import load_config

        storage = Path(load_config(str(tiny_job)).ray.storage_path)
        before = sorted(storage.rglob("*")) if storage.is_dir() else []
        r = run("train", "--config", tiny_job, "--name", "no-ray-here", "--address", http_addr)
        assert_one_line(r, f"cannot connect to Ray at '{http_addr}'", "not a Ray cluster")
        assert "(logs: " not in r.stderr and not (storage / "no-ray-here").exists(), r.stderr
        assert (sorted(storage.rglob("*")) if storage.is_dir() else []) == before
        monkeypatch.setenv("RAY_ADDRESS", silent_addr)
        assert_one_line(run("teachers", "status", "--config", tiny_job, "--address", "auto"),
                        f"({silent_addr}, from $RAY_ADDRESS)", "answers nothing within 3 s")
    finally:
        http_server.shutdown()
        silent.close()


def test_a_carved_synthetic_source_reads_only_the_records_it_carves():
    """A synthetic source makes as many records as asked (it has no "every record"): carving validation and test
    from its training split asks for num_train + num_val + num_test of them, as before the null shares."""
    from kava_ray.common.config import load_config
    from kava_ray.data.splits import _carved_records

    cfg = load_config("demo_cpu", ["data.test_split=train"])
    assert [len(x) for x in _carved_records(cfg.data)] == [cfg.data.num_train, cfg.data.num_val, cfg.data.num_test]


def test_the_vllm_engine_is_refused_in_one_line_where_vllm_is_missing_or_nothing_is_sampled(run_cli, tiny_job,
                                                                                            monkeypatch):
    """`onpolicy.engine: vllm` where vLLM is not installed: the install command, before anything starts; a typo in
    the key; the engine of a job that samples nothing. `teachers[].engine: vllm`: the same install line; a job that
    asks it for KV, or learns its fusion from KV. Each one line, exit 2, no run directory."""
    import kava_ray.rollout.vllm_engine

    on = ["onpolicy.fraction=0.5", "loss.logit_weight=1"]
    monkeypatch.setattr(kava_ray.rollout.vllm_engine, "vllm_available", lambda: False)
    r = refused(run_cli, tiny_job, *on, "onpolicy.engine=vllm", needles=("onpolicy.engine: vllm", "not installed",
                                                                         "pip install 'kava-ray[vllm]'"))
    assert r.startswith("error: onpolicy.engine: vllm: vLLM is not installed here"), r
    refused(run_cli, tiny_job, *on, "onpolicy.engin=vllm", needles=("onpolicy.engin", "did you mean 'onpolicy.engine'"))
    refused(run_cli, tiny_job, "onpolicy.engine=vllm", needles=("'onpolicy.engine': vllm samples the student's",
                                                                "set onpolicy.engine=hf"))
    logits = ["teachers.0.engine=vllm", "loss.kv_weight=0", "loss.logit_weight=1"]
    r = refused(run_cli, tiny_job, *logits, needles=("teachers[", "].engine: vllm", "not installed"))
    assert r.startswith("error: teachers[") and "pip install 'kava-ray[vllm]'" in r, r
    refused(run_cli, tiny_job, "teachers.0.engine=vllm", "loss.logit_weight=1",
            needles=("].engine': vllm serves log-probs only", "loss.kv_weight is 1", "set it to 0"))
    refused(run_cli, tiny_job, *logits, "fusion.kind=gate", needles=("fusion.kind gate learns its weights",))
    # a vLLM teacher across GPUs is tensor parallel over them: a whole number of GPUs, before Ray
    refused(run_cli, tiny_job, *logits, "teachers.0.num_gpus=1.5",
            needles=("]: engine vllm shards the teacher over its num_gpus (1.5, tensor parallelism), which must then "
                     "be a whole number of GPUs",))
