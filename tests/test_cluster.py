"""Where users run it: cluster.yaml, runtime_env.yaml, and `Head`: a real `ray start --head --block` in a new
session with its own --temp-dir and ports, stopped by its own pids (never `ray stop`, which would stop every Ray
on the machine, including the embedded one the other tests share, `ray_session`). The `ray job submit` test
runs on the head tests/test_service_ray.py starts.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's bin: `ray`, `kava-ray`
MIB = 1024 * 1024


# --------------------------------------------------------------------------------------- cluster.yaml


def _cluster_config() -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((REPO / "cluster.yaml").read_text())
    cfg = prepare_config(raw)  # defaults for the provider, merged setup commands, min/max per node type
    validate_config(cfg)  # Ray 2.60's ray-schema.json plus its own cross-field checks
    return cfg


def test_cluster_yaml_is_a_valid_launcher_config_with_room_for_the_teachers():
    import ray

    cfg = _cluster_config()
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"].get("CPU") == 0

    teacher, student = types["teacher_gpu"], types["student_gpu"]
    # 72B bf16 on 4 GPUs of one node (PACK) + 14B on 2 + 7B on 1.
    assert teacher["resources"]["GPU"] >= 4 + 2 + 1
    assert student["resources"]["GPU"] >= 1
    assert teacher["min_workers"] >= 1 and student["min_workers"] >= 1
    assert sum(t["min_workers"] for t in types.values()) <= cfg["max_workers"]
    assert all(t["max_workers"] >= t["min_workers"] for t in types.values())

    docker = cfg["docker"]
    assert f":{ray.__version__}-" in docker["image"] and "ray-ml" not in docker["image"]
    shm = [o for o in docker["run_options"] if o.startswith("--shm-size=")]
    assert len(shm) == 1 and shm[0].endswith("g") and int(shm[0].split("=")[1][:-1]) >= 64

    # The checkout travels to every node and is installed there.
    assert cfg["file_mounts"]["~/kava-ray"] == "."
    for cmds in (cfg["head_setup_commands"], cfg["worker_setup_commands"]):
        assert any("pip install" in c and "$HOME/kava-ray" in c for c in cmds)

    # Token authentication: the client's token file becomes every node's, and every `ray start` asks for it.
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    starts = [c for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token ray start" in c for c in starts)


# --------------------------------------------------------------------------------- runtime_env.yaml


def _runtime_env() -> dict:
    return yaml.safe_load((REPO / "runtime_env.yaml").read_text())


def _package(working_dir: Path, out: Path, include_gitignore: bool = True, runtime_env: dict | None = None):
    """The zip `ray job submit --runtime-env runtime_env.yaml --working-dir DIR` uploads, built by Ray's code.

    Ray's job SDK calls upload_working_dir_if_needed (default excludes + the runtime env's `excludes`;
    .gitignore/.rayignore are read while walking) and hands the excludes to its upload hook.
    """
    from ray._private.runtime_env.packaging import create_package
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    env = {**(_runtime_env() if runtime_env is None else runtime_env), "working_dir": str(working_dir)}
    seen = {}

    def capture(path, excludes, is_file=False):  # what the job SDK's upload hook receives
        seen.update(path=path, excludes=list(excludes))

    upload_working_dir_if_needed(env, include_gitignore=include_gitignore, upload_fn=capture)
    assert seen["path"] == str(working_dir)
    create_package(str(working_dir), out, include_gitignore=include_gitignore, excludes=seen["excludes"])
    return zipfile.ZipFile(out)


@pytest.mark.parametrize("gitignore", [True, False], ids=["gitignore", "ignore-gitignore"])
def test_working_dir_upload_stays_far_below_the_job_server_limit(tmp_path, gitignore):
    from ray._private import ray_constants

    limit = ray_constants.DASHBOARD_CLIENT_MAX_SIZE  # aiohttp's request cap on the job server: 100 MiB
    assert limit == 100 * MIB
    out = tmp_path / "pkg.zip"
    names = _package(REPO, out, include_gitignore=gitignore).namelist()
    size = out.stat().st_size
    print(f"working_dir package: {size / MIB:.2f} MiB, {len(names)} files")
    assert size < limit / 10
    assert "kava_ray/cli/__init__.py" in names and "actors/pool.py" in names and "runtime_env.yaml" in names
    for top in (".venv/", ".git/", "kava_runs/", "runs/", ".pytest_cache/"):
        assert not any(n.startswith(top) for n in names), top
    assert not any(n.endswith((".safetensors", ".gguf", ".pyc")) or "__pycache__" in n for n in names)


def test_runtime_env_excludes_alone_drop_weights_runs_and_environments(tmp_path, monkeypatch):
    """Even without .gitignore help (and with Ray's default excludes overridden), nothing heavy travels."""
    wd = tmp_path / "checkout"
    for rel in (".venv/lib/torch.so", ".git/objects/ab", "kava_runs/x/metrics.jsonl", "runs/y/state.json",
                "models/teacher.safetensors", "student.gguf", "kvcache/shard-0.safetensors", "deep/a/b/c.pt",
                "kava_ray/__pycache__/cli.cpython-311.pyc", "x.egg-info/PKG-INFO"):
        (wd / rel).parent.mkdir(parents=True, exist_ok=True)
        (wd / rel).write_bytes(b"0" * 1024)
    (wd / "kava_ray").mkdir(exist_ok=True)
    (wd / "kava_ray" / "cli.py").write_text("print('hi')\n")
    (wd / "job.yaml").write_text("name: x\n")
    (wd / ".gitignore").write_text("*\n")  # ignored here: include_gitignore=False
    monkeypatch.setenv("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES", "")  # Ray's own .git/.venv defaults off
    names = sorted(n for n in _package(wd, tmp_path / "p.zip", include_gitignore=False).namelist()
                   if not n.endswith("/"))
    assert names == [".gitignore", "job.yaml", "kava_ray/cli.py"]


def test_plain_working_dir_upload_drops_weights_through_rayignore(tmp_path):
    """`ray job submit --working-dir .` without runtime_env.yaml: Ray's defaults + the repo's .rayignore."""
    wd = tmp_path / "checkout"
    for rel in (".venv/lib/torch.so", ".git/HEAD", "models/teacher.safetensors", "student.gguf",
                "kvcache/manifest.json", "kava_runs/x/metrics.jsonl", "ckpt/optimizer.pt", "kava_ray/cli.py"):
        (wd / rel).parent.mkdir(parents=True, exist_ok=True)
        (wd / rel).write_bytes(b"0" * 1024)
    shutil.copy(REPO / ".rayignore", wd / ".rayignore")
    names = sorted(n for n in _package(wd, tmp_path / "p.zip", runtime_env={}).namelist() if not n.endswith("/"))
    assert names == [".rayignore", "kava_ray/cli.py"]


# ------------------------------------------------------------------------- ray job submit, end to end


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _client_env(**extra) -> dict:
    """A client shell: token auth on, the token from ~/.ray/auth_token unless `extra` says otherwise.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is Ray's single-machine mode: 127.0.0.1 stays 127.0.0.1. Without
    it Ray on Linux rewrites a loopback address to the machine's routable IP, for `ray start
    --node-ip-address 127.0.0.1` (whose gRPC servers then listen on 0.0.0.0) and for clients alike.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(RAY_AUTH_MODE="token", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    env.update(extra)
    return env


def _ray(*args, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *args], env=env or _client_env(), capture_output=True, text=True,
                          timeout=timeout)


def _ip(hex_addr: str) -> str:
    """/proc/net/tcp{,6} local address (32-bit little-endian words) -> text."""
    import ipaddress

    raw = b"".join(bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, len(hex_addr), 8))
    ip = ipaddress.ip_address(raw)
    return str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)


class Head:
    """One `ray start --head --block` in its own session; stop() ends exactly its processes."""

    def __init__(self, num_cpus: int = 8):
        self.temp_dir = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # short: Ray's socket paths live here
        self.gcs_port, self.dashboard_port, client_port, agent_port = _free_ports(4)
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.gcs_address = f"127.0.0.1:{self.gcs_port}"
        env = _client_env(  # with it, every server of this head listens on 127.0.0.1 only
            # SIGTERM drains the node for up to 30 s first (Ray 2.60); tear down at once instead.
            RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
            HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
        )
        self.log = open(Path(self.temp_dir) / "ray_start.log", "w+")
        self.proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
             "--port", str(self.gcs_port),
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
             "--ray-client-server-port", str(client_port), "--dashboard-agent-listen-port", str(agent_port),
             "--num-cpus", str(num_cpus), "--object-store-memory", str(256 * MIB), "--include-dashboard", "true",
             "--disable-usage-stats", "--temp-dir", self.temp_dir],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.sid = self.proc.pid  # session id of every process this head starts (except job drivers)

    def wait_started(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = Path(self.log.name).read_text()
            if "Ray runtime started" in text:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"ray start --head exited {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.5)
        raise AssertionError(f"head not up in {timeout_s} s:\n{Path(self.log.name).read_text()[-3000:]}")

    def _own_pids(self, marker: str | None) -> list[int]:
        """Processes in this head's session, or whose command line names its temp dir / `marker`."""
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                pid = int(d.name)
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if os.getsid(pid) == self.sid or self.temp_dir in cmd or (marker and marker in cmd):
                    pids.append(pid)
            except (OSError, ProcessLookupError):
                continue
        return pids

    def listening(self) -> set[str]:
        """Local addresses of the TCP sockets this head's processes listen on (from /proc/net/tcp{,6})."""
        inodes = set()
        for pid in self._own_pids(None):
            try:
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    link = os.readlink(fd)
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
            except OSError:
                continue
        found = set()
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:  # state LISTEN, owned by one of ours
                    found.add(_ip(f[1].split(":")[0]))
        return found

    def stop(self, marker: str | None = None) -> list[int]:
        """SIGTERM `ray start --block` (it tears its node down), then SIGKILL whatever of ours is left.

        `marker` (the job's config path) also catches the job driver: Ray starts it in a session of
        its own and only kills it once its supervisor is gone. Returns the pids that survived.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while (pids := self._own_pids(marker)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.3)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return self._own_pids(marker)
