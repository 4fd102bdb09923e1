"""Config loading, dotted overrides and the one-line error contract of `kava-ray config show`.

The CLI runs in-process (`kava_ray.cli.main`, what the console script calls); one test runs the
installed `kava-ray` command itself.
"""

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from kava_ray.cli import main
from kava_ray.common.config import config_hash, diff_keys, load_config, preset_names
from kava_ray.common.errors import KavaError


@pytest.fixture
def run_cli(capsys):
    """`kava-ray ARGS` in this process: .returncode, .stdout, .stderr, like subprocess.run's result."""
    def run(*args):
        capsys.readouterr()  # drop what came before
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)
    return run


def test_installed_console_script_runs_and_reports_errors_in_one_line():
    """The `kava-ray` entry point of the installed package (the only subprocess in this file)."""
    exe = shutil.which("kava-ray", path=str(Path(sys.executable).parent))
    assert exe, "the kava-ray console script is not installed next to this Python"
    ok = subprocess.run([exe, "config", "show", "--config", "demo_cpu", "train.steps=7"], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["train"]["steps"] == 7
    bad = subprocess.run([exe, "config", "show", "--config", "demo_cpu", "optim.lr_student=0"], capture_output=True,
                         text=True, timeout=120)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and bad.stdout == "", bad.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "optim.lr_student" in lines[0], bad.stderr


def test_presets_load_and_overrides_apply():
    assert "demo_cpu" in preset_names()
    cfg = load_config("demo_cpu", ["optim.lr_student=3e-5", "teachers.1.num_gpus=0.5", "align.mode=flat"])
    assert cfg.optim.lr_student == pytest.approx(3e-5)
    assert cfg.teachers[1].num_gpus == 0.5
    assert cfg.align.mode == "flat"
    # the override did not leak into a fresh load
    assert load_config("demo_cpu").align.mode == "structured"


def test_config_show_prints_resolved_yaml_that_round_trips(run_cli, tmp_path):
    r = run_cli("config", "show", "--config", "demo_cpu", "train.steps=7")
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert shown["train"]["steps"] == 7
    path = tmp_path / "job.yaml"
    path.write_text(r.stdout)
    assert load_config(path).train.steps == 7


def test_config_hash_and_diff_name_the_shape_keys():
    a = load_config("demo_cpu")
    b = load_config("demo_cpu", ["align.projector.mlp_ratio=2.0", "optim.lr_student=1e-4"])
    assert config_hash(a) != config_hash(b)
    assert diff_keys(a, b) == ["align.projector.mlp_ratio"]  # optimiser keys may change on resume


BAD = [
    # (description, extra args, key that the one line must name)
    ("unknown key", ["optim.lr_studnet=1e-4"], "optim.lr_studnet"),
    ("wrong type", ["train.steps=many"], "train.steps"),
    ("lr <= 0", ["optim.lr_student=0"], "optim.lr_student"),
    ("negative lr", ["optim.lr_projector=-1e-3"], "optim.lr_projector"),
    ("mlp_ratio <= 0", ["align.projector.mlp_ratio=0"], "align.projector.mlp_ratio"),
    ("dropout >= 1", ["align.projector.dropout=1.0"], "align.projector.dropout"),
    ("dropout < 0", ["align.projector.dropout=-0.1"], "align.projector.dropout"),
    ("duplicate teacher", ["teachers.1.name=smollm2-fp32"], "smollm2-fp32"),
    ("malformed override", ["optim.lr_student"], "optim.lr_student"),
    ("empty override key", ["=3"], "KEY=VALUE"),
    ("negative num_gpus", ["teachers.0.num_gpus=-1"], "teachers.0.num_gpus"),
    ("bad literal", ["align.mode=wide"], "align.mode"),
    ("fusion weights count", ["fusion.weights=[1.0]"], "fusion.weights"),
    ("list index out of range", ["teachers.5.name=x"], "teachers.5"),
]


@pytest.mark.parametrize("desc,extra,key", BAD, ids=[b[0] for b in BAD])
def test_bad_override_is_one_line_exit_2(run_cli, desc, extra, key):
    r = run_cli("config", "show", "--config", "demo_cpu", *extra)
    assert r.returncode == 2, (desc, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert key in lines[0], (key, lines[0])
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_unknown_preset(run_cli):
    r = run_cli("config", "show", "--config", "no_such_preset")
    assert r.returncode == 2 and "no_such_preset" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_required_field_and_bad_yaml(run_cli, tmp_path):
    no_student = tmp_path / "no_student.yaml"
    no_student.write_text("teachers:\n  - {name: a, model: some/model}\n")
    r = run_cli("config", "show", "--config", str(no_student))
    assert r.returncode == 2 and "'student'" in r.stderr and "missing" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1

    broken = tmp_path / "broken.yaml"
    broken.write_text("teachers: [\n  name: a\n")
    r = run_cli("config", "show", "--config", str(broken))
    assert r.returncode == 2 and "not valid YAML" in r.stderr and "Traceback" not in r.stderr


def test_load_config_raises_kava_error_in_process():
    with pytest.raises(KavaError, match="optim.lr_student"):
        load_config("demo_cpu", ["optim.lr_student=-1"])


def test_a_renamed_key_says_what_it_is_called_now(capsys):
    from kava_ray.cli import main

    assert main(["config", "show", "--config", "demo_cpu", "data.num_eval=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: config key 'data.num_eval': unknown key (renamed to data.num_test)"], err


@pytest.mark.parametrize("override,suggestion", [
    ("ray.worker_label_selectr={kava-role: student}", " (did you mean 'ray.worker_label_selector'?)"),
    ("teachers.0.label_selectr={kava-role: teacher}", " (did you mean 'teachers.0.label_selector'?)"),
    ("trian.steps=3", " (did you mean 'train'?)"),
    ("loss.zzz=1", ""),  # nothing close: the line says no more than "unknown key"
])
def test_a_misspelt_key_names_the_key_it_is_close_to(capsys, override, suggestion):
    from kava_ray.cli import main

    assert main(["config", "show", "--config", "demo_cpu", override]) == 2
    key = override.split("=")[0].split(".")
    loc = ".".join(key[:1] if key[0] == "trian" else key)
    assert capsys.readouterr().err.strip().splitlines() == [f"error: config key {loc!r}: unknown key{suggestion}"]


def _leaves(parser, path=()):
    """Every runnable (sub)command of a parser: (its words, its parser)."""
    subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    if not subs:
        return [(path, parser)]
    return [leaf for name, p in subs[0].choices.items() for leaf in _leaves(p, (*path, name))]


def test_every_command_has_a_handler_and_no_module_loads_torch_or_ray():
    """One module per command (kava_ray/cli/): each leaf parser names its handler; importing them all (what
    `kava-ray --help` does) loads no torch, Ray or pydantic, in a fresh interpreter."""
    from kava_ray.cli import build_parser

    leaves = _leaves(build_parser())
    assert [words for words, p in leaves if not callable(p.get_default("func"))] == []
    assert len(leaves) == 31  # 12 commands; config 2, teachers 4, bench 16 subcommands
    code = ("import sys, kava_ray.cli; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray', 'pydantic'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_options_between_overrides_in_every_command_that_takes_them(capsys):
    """Every command with KEY=VALUE overrides takes its options anywhere among them (argparse's intermixed
    parsing): `train --config job.yaml train.steps=2 --name x onpolicy.fraction=1` keeps both overrides."""
    from kava_ray.cli import build_parser

    leaves = [(words, p) for words, p in _leaves(build_parser()) if "overrides" in {a.dest for a in p._actions}]
    assert len(leaves) == 19
    for words, p in leaves:
        needed = [x for a in p._actions if a.required and a.option_strings for x in (a.option_strings[0], "X")]
        places = ["RUN" for a in p._actions if not a.option_strings and a.dest != "overrides"]
        option = next(a for a in p._actions if a.option_strings and a.nargs is None and a.type is None
                      and a.choices is None and a.const is None)
        argv = [*words, *needed, *places, "a.b=1", option.option_strings[0], "V", "c.d=2"]
        args = build_parser().parse_args(argv)
        assert args.overrides == ["a.b=1", "c.d=2"] and getattr(args, option.dest) == "V", (words, vars(args))
    args = build_parser().parse_args(["train", "--config", "job.yaml", "train.steps=2", "--name", "x",
                                      "onpolicy.fraction=1", "--verbose"])
    assert (args.overrides, args.name, args.verbose) == (["train.steps=2", "onpolicy.fraction=1"], "x", True)
    assert build_parser().parse_args(["eval", "RUN"]).overrides == []  # none is fine, and not named as missing:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("the following arguments are required: "
                                                                     "RUN_OR_CHECKPOINT")


def test_python_dash_m_runs_the_command():
    """`python -m kava_ray.cli` (how test_actors and the multi-node test run it) is the console script."""
    out = subprocess.run([sys.executable, "-m", "kava_ray.cli", "config", "presets"], capture_output=True, text=True,
                         timeout=60)
    rows = [line.split() for line in out.stdout.splitlines()]
    assert out.returncode == 0 and [r[0] for r in rows] == preset_names(), out.stderr
    assert all(Path(path).is_file() and Path(path).name == f"{name}.yaml" for name, path in rows)  # where they live
