"""kava-ray's own Ray on one machine: loopback only, its own (never a `ray start --head`'s); a teacher pool and a
submitted job on a loopback head with token auth; an address nothing answers at fails fast (a sweep's relative
storage path: tests/test_tune.py; `--address auto`'s reading of Ray's address file: tests/test_preflight.py).

Every Ray here runs in a subprocess (the test session's own Ray is left alone) with RAY_TMPDIR pointing at
a temp dir of the test: Ray reads `<RAY_TMPDIR>/ray/ray_current_cluster` (the last `ray start --head`'s GCS
address), so the test writes that file there instead of touching the machine's /tmp/ray. Subprocesses run
without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (conftest sets it for the test session): kava_ray.runtime.connect alone
must give loopback. The head (test_cluster.Head) is stopped by its own pids, never `ray stop`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from jobs import write_job
from test_cluster import BIN, REPO, Head, _client_env, _ray

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _env(ray_tmpdir: Path) -> dict:
    """A user's shell: token auth on (the head's too), no RAY_ADDRESS, no single-machine switch of its own."""
    env = _client_env(RAY_TMPDIR=str(ray_tmpdir), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    return env


@pytest.fixture(scope="module")
def address_dir():
    """make(address): a RAY_TMPDIR whose ray/ray_current_cluster names `address` (in /tmp, short: Ray's
    socket paths live under it); removed after the module (its embedded Rays have exited by then)."""
    made = []

    def make(address: str) -> Path:
        d = Path(tempfile.mkdtemp(prefix="kvt", dir="/tmp"))
        (d / "ray").mkdir()
        (d / "ray" / "ray_current_cluster").write_text(address)
        made.append(d)
        return d

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def _sessions(ray_tmpdir: Path) -> list[Path]:
    return sorted(p for p in (ray_tmpdir / "ray").glob("session_2*") if p.is_dir())


@pytest.fixture(scope="module")
def head():
    """A `ray start --head` on loopback with token auth (README "Three ways to run"), 8 logical CPUs."""
    h = Head(num_cpus=8)
    try:
        h.wait_started()
        yield h
    finally:
        left = h.stop()
        assert not left, f"head processes survived: {left}"


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir):
    root = tmp_path_factory.mktemp("svc")
    return write_job(root, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir,
                     train={"steps": 2, "eval_steps": 2, "save_steps": 2, "max_length": 160},
                     data={"num_train": 32, "num_test": 4, "num_val": 4})


def _kava(*args, env: dict, cwd=None, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "kava-ray"), *map(str, args)], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def head_pool(head, job, address_dir):
    """`kava-ray teachers up --address HEAD`: the job's teachers as detached actors on the head, which the
    submitted job below finds by name (README: a pool that outlives the commands using it). The last
    test of the module takes it down."""
    env = _env(address_dir("127.0.0.1:1"))
    up = _kava("teachers", "up", "--config", job, "--address", head.gcs_address, env=env)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
    # a quiet console: the one result line; the actors' and Ray's lines are in ray.storage_path's logs/
    assert re.fullmatch(r"started 2 teacher\(s\) in namespace '[\w-]+': qwen, llama", up.stdout.strip()), up.stdout
    assert up.stderr == "", up.stderr
    return env


def test_teachers_up_on_the_head_outlives_the_command_and_status_lists_it(head, job, own_train, head_pool,
                                                                        address_dir):
    # `--address auto` from a shell that exported nothing: found through Ray's address file, the head's token
    # sent from ~/.ray/auth_token, as `ray.init(address="auto")` does (the README's `ray start --head && kava-ray
    # ... --address auto`); with an explicit address Ray sends it only under RAY_AUTH_MODE=token
    bare = {k: v for k, v in _env(address_dir(head.gcs_address)).items() if k != "RAY_AUTH_MODE"}
    r = _kava("teachers", "status", "--config", job, "--address", "auto", "--json", env=bare, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "4x2x16" in r.stdout and "3x2x32" in r.stdout  # the geometry columns of the table
    rows = json.loads(r.stdout.strip().splitlines()[-1])["teachers"]
    assert {row["name"]: row["quantization"] for row in rows} == {"qwen": "none", "llama": "4bit"}
    assert all(row["running"] for row in rows)


@pytest.fixture(scope="module")
def own_train(head, job, address_dir, tmp_path_factory):
    """`kava-ray train` without --address, beside the head (Ray's address file names it: what `ray.init()` would
    join), started in the background as soon as the head is up: it runs while the other tests of this module do
    (they mostly wait on Ray's start-up, not on the 2 cores), and its test collects it."""
    tmpdir = address_dir(head.gcs_address)
    cwd = tmp_path_factory.mktemp("own")
    cfg = yaml.safe_load(job.read_text())
    cfg["ray"]["storage_path"] = "runs"  # relative to its CWD
    cfg["teachers"] = cfg["teachers"][:1]  # one teacher is enough to show where its server listens
    (cwd / "job.yaml").write_text(yaml.safe_dump(cfg))
    with open(cwd / "out.txt", "w") as out, open(cwd / "err.txt", "w") as err:  # files: a pipe could fill up
        proc = subprocess.Popen([str(BIN / "kava-ray"), "train", "--config", "job.yaml", "--name", "own"], cwd=cwd,
                                env=_env(tmpdir), stdout=out, stderr=err)
    sockets: dict = {}
    watcher = threading.Thread(target=_watch_listening, args=(proc, sockets), daemon=True)
    watcher.start()
    yield proc, cwd, tmpdir, time.monotonic(), sockets
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _watch_listening(proc: subprocess.Popen, seen: dict) -> None:
    """Until `proc` exits: every listening TCP socket of it and the processes under it (its embedded Ray, the
    teachers, the Ray Train worker), as {(ip, port): process title}, polled every 0.5 s (each poll reads every
    process's sockets: ~20 ms of CPU with a few hundred processes, the whole run long). One system-wide read of
    the socket tables per poll (a read per process took seconds per poll on a loaded box); a socket's title is its
    owner's latest (a Ray worker starts as `ray::IDLE` and is
    renamed when it becomes an actor)."""
    import psutil

    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            pids = {root.pid} | {c.pid for c in root.children(recursive=True)}
        except psutil.NoSuchProcess:
            return
        for c in psutil.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.pid in pids:
                try:
                    p = psutil.Process(c.pid)
                    key, title = (c.laddr.ip, c.laddr.port), " ".join(p.cmdline())
                    # an exiting process reads an empty command line: keep what it was (its 15-character name last)
                    seen[key] = title or seen.get(key) or p.name()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    pass
        time.sleep(0.5)


def test_train_without_address_runs_its_own_ray_on_loopback_beside_a_head(own_train, head):
    """...saying so in one note line, with every server of the run (its embedded Ray's, the teachers', the Ray
    Train worker's torch.distributed store) on loopback; on a quiet console: status lines, then the command's
    table; the chatter of Ray, its workers and the libraries is in RUN_DIR/logs/ (kava_ray.runtime.console)."""
    from test_console import CHATTER

    proc, cwd, tmpdir, t0, sockets = own_train
    proc.wait(timeout=240)
    stdout, stderr = (cwd / "out.txt").read_text(), (cwd / "err.txt").read_text()
    print(f"train (in the background since the head was up): {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    # every server of the run, the Ray Train worker's torch.distributed store included, listened on loopback only
    for (ip, port), title in sorted(sockets.items(), key=lambda kv: kv[1]):
        print(f"{'ok ' if ip in LOOPBACK else 'BAD'} {ip:>18}:{port:<6} {title[:100]}")
    assert any(title.startswith("ray::RayTrainWorker") for title in sockets.values()), sockets
    assert any("gcs_server" in title for title in sockets.values()) and len(sockets) >= 5, sockets  # Ray's own too
    assert not {k: t for k, t in sockets.items() if k[0] not in LOOPBACK}, sockets
    assert len(_sessions(tmpdir)) == 1  # an embedded Ray of its own started (the head's session is elsewhere)
    run_dir = (cwd / "runs" / "own").resolve()
    assert (run_dir / "final" / "student" / "config.json").is_file()

    # the status lines, in order, with one note as it connects, and nothing else on stderr (no tty: no progress bar)
    err = stderr.splitlines()
    assert err[1] == (f"note: a Ray cluster is running on this machine ({head.gcs_address}); kava-ray uses its own "
                      f"embedded Ray unless you pass --address auto"), err
    del err[1]
    assert [line.split(":")[0] for line in err] == ["data", "connecting", "teachers", "training", "loss", "test",
                                                    "logs"], err
    assert err[0].startswith("data: ") and " training, " in err[0] and "(synthetic)" in err[0]
    assert "embedded Ray (" in err[1] and "127.0.0.1" in err[1]
    assert err[2].startswith("teachers: 1 ready (qwen) in ")
    assert err[3] == f"training: 2 steps, 1 worker -> {run_dir}"
    assert err[4].startswith("loss: ce 1 + kv ") and "(mercator, fusion fixed)" in err[4], err[4]  # what it trains on
    assert err[5].startswith("test: CE ") and "KV cos to the fused teachers" in err[5] and "(centred)" in err[5]
    assert err[6] == f"logs: {run_dir / 'logs'}"
    assert stdout.splitlines()[-1].startswith(f"run dir: {run_dir}")  # the command's own output: the table
    console = stdout + stderr
    for word in CHATTER:
        assert word not in console, (word, console)
    assert len(console.splitlines()) < 40, console
    logs = run_dir / "logs"
    assert (logs / "driver.log").is_file()
    text = {p.relative_to(logs).as_posix(): p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file()}
    assert any("Loading weights" in t for t in text.values()), sorted(text)  # the teachers' / worker's bars
    assert any(name.startswith("ray/TeacherActor-") for name in text), sorted(text)
    assert any(name.startswith("ray/train/") for name in text), sorted(text)  # Ray Train's own logs


JOB_ENV = textwrap.dedent("""
    import os, sys, ray
    from kava_ray.runtime.connect import connect

    connect(sys.argv[1], "kava-env")
    print(ray.get(ray.remote(lambda: os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")).remote()))
""")


def test_a_driver_joining_a_cluster_gives_its_workers_trains_fast_poll(head, address_dir):
    """Ray Train's controller takes one report per worker per poll (2 s by default): a job joining a cluster sets
    the poll of its own workers as an embedded Ray does (kava_ray.runtime.connect.TRAIN_ENV), or a run on `ray start
    --head` would take at least 2 s per logged step."""
    out = subprocess.run([sys.executable, "-c", JOB_ENV, head.gcs_address], env=_env(address_dir("127.0.0.1:1")),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "0.2", out.stdout + out.stderr[-3000:]


def test_an_address_nothing_answers_at_fails_in_one_line(job, address_dir):
    t0 = time.monotonic()
    out = subprocess.run([str(BIN / "kava-ray"), "train", "--config", str(job), "--address", "127.0.0.1:1"],
                         env=_env(address_dir("127.0.0.1:1")), capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    print(f"--address 127.0.0.1:1: exit {out.returncode} in {took:.1f} s: {out.stderr.strip()}")
    assert out.returncode == 2 and took < 30
    lines = out.stderr.strip().splitlines()
    # the data is prepared (and checked) in the driver before Ray: its status line, then the one-line error
    errors = [x for x in lines if not x.startswith("data: ")]
    assert len(errors) == 1 and errors[0].startswith("error: cannot connect to Ray at '127.0.0.1:1'"), out.stderr


# ------------------------------------------------------------------------- ray job submit, end to end


def test_job_submit_with_token_auth_runs_a_job_on_the_cluster(head, head_pool, tmp_path, tiny_qwen2_dir,
                                                              tiny_llama_dir, tiny_student_dir):
    """`ray job submit` of `kava-ray train` with the repo as working dir, on the loopback head with token auth:
    clients without the token are refused, the job's driver uses the cluster (it says so, and trains with the
    head's teacher pool and a Train worker of the head), and the run lands in the job's storage path."""
    runs = tmp_path / "runs"
    job = write_job(tmp_path, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir,
                    train={"steps": 2, "eval_steps": 2, "save_steps": 2, "max_length": 160},
                    ray={"num_workers": 1, "use_gpu": False, "storage_path": str(runs)})
    # The documented first step for `ray start` with token auth: a token in ~/.ray/auth_token (kept if
    # one exists; an embedded ray.init() writes the same file).
    gen = _ray("get-auth-token", "--generate")
    assert gen.returncode == 0, gen.stderr
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    assert token and gen.stdout.strip() == token

    t0 = time.monotonic()
    sub_id = f"kava-test-{uuid.uuid4().hex[:8]}"
    try:
        listening = head.listening()
        assert listening and listening <= {"127.0.0.1", "::1"}, listening  # loopback only
        submit = _ray("job", "submit", "--address", head.address, "--submission-id", sub_id,
                      "--runtime-env", str(REPO / "runtime_env.yaml"), "--working-dir", str(REPO), "--no-wait",
                      "--", "kava-ray", "train", "--config", str(job), timeout=120)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        said = submit.stdout + submit.stderr
        assert f"Job '{sub_id}' submitted successfully" in said
        assert re.search(r"Uploading package gcs://_ray_pkg_[0-9a-f]+\.zip", said), said  # the working dir

        # While it runs: clients without the token are refused. Note the first: the job CLI sends the
        # token only when RAY_AUTH_MODE=token is set on the client, even with ~/.ray/auth_token present.
        no_mode = subprocess.Popen([str(BIN / "ray"), "job", "list", "--address", head.address],
                                   env={k: v for k, v in _client_env().items() if k != "RAY_AUTH_MODE"},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wrong = _ray("job", "status", sub_id, "--address", head.address, env=_client_env(RAY_AUTH_TOKEN="wrong"))
        assert wrong.returncode != 0 and "Invalid authentication token" in wrong.stdout + wrong.stderr
        out, _ = no_mode.communicate(timeout=60)
        assert no_mode.returncode != 0 and "Missing authentication token" in out

        print(f"submitted + auth checks: {time.monotonic() - t0:.1f} s")
        # `ray job logs --follow` returns when the job ends.
        try:
            logs = _ray("job", "logs", sub_id, "--follow", "--address", head.address, timeout=180).stdout
        except subprocess.TimeoutExpired:
            logs = _ray("job", "logs", sub_id, "--address", head.address).stdout
        print(f"job ended: {time.monotonic() - t0:.1f} s")
        status = _ray("job", "status", sub_id, "--address", head.address)
        text = status.stdout + status.stderr
        assert f"Job '{sub_id}' succeeded" in text, f"{text}\n--- ray job logs {sub_id} ---\n{logs[-8000:]}"
        assert "run dir:" in logs

        # The job's driver used the cluster (RAY_ADDRESS, set by the job server), not an embedded Ray: it says
        # so, found the head's pool, and its Train worker is an actor of this head.
        assert re.search(r"^connecting: Ray at \S+ \(8 CPUs", logs, re.M), logs[-3000:]
        assert re.search(r"^teachers: 2 already running \(qwen, llama\)", logs, re.M), logs[-3000:]
        actors = _ray("list", "actors", "--address", head.gcs_address, "--format", "json", "--limit", "1000")
        assert actors.returncode == 0, actors.stderr
        assert "RayTrainWorker" in {a["class_name"] for a in json.loads(actors.stdout)}
        (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert max(r.get("step", -1) for r in records) == 2
        assert (run_dir / "final" / "student" / "config.json").is_file()
        print(f"job submit end to end: {time.monotonic() - t0:.0f} s")
    finally:  # the driver of a job that did not end (a failed assertion above): stop it, leave the head
        _ray("job", "stop", sub_id, "--address", head.address)


def test_teachers_down_stops_the_heads_pool(head, job, head_pool):
    """(Last in the module.) `kava-ray teachers down` stops the pool `teachers up` started on the head."""
    down = _kava("teachers", "down", "--config", job, "--address", head.gcs_address, env=head_pool)
    assert down.returncode == 0 and "qwen" in down.stdout and "llama" in down.stdout, down.stdout + down.stderr
    r = _kava("teachers", "status", "--config", job, "--address", head.gcs_address, "--json", env=head_pool)
    assert r.returncode == 0 and not any(row["running"] for row in json.loads(r.stdout.strip().splitlines()[-1])
                                         ["teachers"]), r.stdout
