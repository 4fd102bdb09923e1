"""Connecting to Ray: an existing cluster (`--address auto` / `ray://...` / host:port) or an
embedded one, and leaving it (`ray_session`, `owned_ray`, `disconnect`: the one place Ray is shut
down).

No address: a fresh embedded Ray of this process's own on 127.0.0.1; an address: a TCP probe first,
then Ray's own join. Single-machine mode and token auth: docs/internals/runtime.md#connect.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Iterator, Optional

import ray

from kava_ray.common.errors import KavaError
from kava_ray.common.files import first_line
from kava_ray.common.signals import sigterm_as_interrupt
from kava_ray.runtime import console
from kava_ray.runtime.console import collect_before_shutdown, ray_started, status
from kava_ray.runtime.ray_private import set_single_machine_constant

# Ray Train V2's controller takes one `ray.train.report` per worker per poll, every 2 s by default:
# a run that reports every step would be throttled to one step per 2 s. Poll faster, on our own Ray
# and on a cluster we join (a job-level env var of this driver's job).
TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}
# An embedded Ray is one machine that no autoscaler drains: Train's PreemptionWatcher actor (a
# process per run that polls the node's drain state every 5 s) has nothing to watch there.
EMBEDDED_ENV = {**TRAIN_ENV, "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "TRANSFORMERS_VERBOSITY": "error"}
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps 127.0.0.1 as the node IP
PROBE_TIMEOUT_S = 3.0  # a TCP connect to the GCS port before ray.init


def single_machine_mode() -> None:
    """Ray's single-machine mode for this process and every process it starts (127.0.0.1 stays
    127.0.0.1): RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 and Ray's already-imported constant; why both:
    docs/internals/runtime.md#connect."""
    os.environ[SINGLE_MACHINE_ENV] = "0"
    set_single_machine_constant()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it), for a Ray port whose fixed default
    another Ray here may hold."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_address_file() -> Path:
    """Where `ray start` records the last head's GCS address and `ray.init(address="auto")` reads
    it: `<$RAY_TMPDIR or $TMPDIR or /tmp>/ray/ray_current_cluster` (Ray's own default temp dir
    rule)."""
    base = os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR") if sys.platform.startswith("linux") else None)
    return Path(base or "/tmp") / "ray" / "ray_current_cluster"


def _host_port(address: str) -> Optional[tuple[str, int]]:
    """'ray://h:p' / 'h:p' / '[::1]:p' -> (h, p); None when it is not of that shape."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def answers(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connect to the address's host:port succeeds within `timeout_s`."""
    hp = _host_port(address)
    if hp is None:
        return False
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            return True
    except (OSError, UnicodeError, ValueError):  # unreachable, or a host name no resolver takes ("'1.2..")
        return False


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + an empty SETTINGS


def speaks(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """What the port at `address` answers an HTTP/2 client preface with: "grpc" (a SETTINGS frame: a
    gRPC server, as Ray's GCS is), "http" (an HTTP/1 server: e.g. the dashboard's 8265), "silent"
    (nothing within `timeout_s`, a port that accepts and never answers: ray.init would wait minutes
    there) or "other"."""
    hp = _host_port(address)
    try:
        with socket.create_connection(hp, timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(HTTP2_PREFACE)
            reply = s.recv(64)
    except socket.timeout:
        return "silent"
    except (OSError, UnicodeError, ValueError, TypeError):
        return "other"
    if len(reply) >= 9 and reply[3] == 4:  # a frame header: length (3), type 4 = SETTINGS
        return "grpc"
    return "http" if reply.startswith(b"HTTP/") or b"<html" in reply.lower() or b"<!doctype" in reply.lower() \
        else "other"


def is_loopback(address: str) -> bool:
    hp = _host_port(address)
    if hp is None:
        return False
    if hp[0] == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(hp[0])
    except ValueError:
        return False
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def running_head() -> Optional[str]:
    """The GCS address of a `ray start --head` on this machine that answers, from Ray's address file."""
    try:
        addr = ray_address_file().read_text().strip()
    except OSError:
        return None
    return addr if addr and answers(addr, timeout_s=0.5) else None


def _resolve_auto() -> str:
    """`--address auto`: $RAY_ADDRESS, else the last `ray start --head` of this machine (Ray's address file)."""
    env = os.environ.get("RAY_ADDRESS")
    if env and env != "auto":
        return env
    path = ray_address_file()
    try:
        addr = path.read_text().strip()
    except OSError:
        addr = ""
    if not addr:
        raise KavaError("--address auto: no running Ray cluster on this machine (start one with `ray start --head`, "
                        "or pass its host:port)")
    return addr


def connect(address: Optional[str], namespace: str, num_cpus: Optional[int] = None,
            require_cluster: bool = False, worker_env: Optional[dict] = None) -> str:
    """Initialise Ray once per process; returns 'embedded' or the address connected to.

    address None -> an embedded local Ray with `num_cpus` logical CPUs (may exceed the physical
    cores: Ray only counts them), unless `require_cluster` (service mode needs a lasting cluster).
    `worker_env`: extra environment variables for every worker and actor of an embedded Ray.
    """
    if ray.is_initialized():
        ray_started()
        return "existing"
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None:
        if require_cluster:
            raise KavaError("this command needs a running Ray cluster: start one with `ray start --head` "
                            "and pass --address auto")
        head = running_head()
        if head:
            status(f"note: a Ray cluster is running on this machine ({head}); kava-ray uses its own embedded Ray "
                   f"unless you pass --address auto")
        single_machine_mode()
        # Fixed defaults (44227, 44217) that a second Ray on this machine would already hold; read
        # by the dashboard and autoscaler processes ray.init starts. (The dashboard agent's HTTP
        # port, 52365, has no ray.init setting: when taken, that agent only serves no HTTP, which an
        # embedded Ray never uses.)
        os.environ["DASHBOARD_METRIC_PORT"] = str(free_port())
        os.environ["AUTOSCALER_METRIC_PORT"] = str(free_port())
        # The dashboard process also serves Ray's state API, which Train's controller and `teachers
        # status` (restart counts) query; workers log at WARNING so progress stays readable.
        # address="local": a Ray of our own even when a `ray start --head` (or the stale file of a
        # killed one) is on this machine; without it ray.init joins that cluster and refuses
        # num_cpus
        ray.init(address="local", num_cpus=num_cpus, namespace=namespace, logging_level="WARNING",
                 log_to_driver=console.LOG_TO_DRIVER,
                 logging_config=ray.LoggingConfig(log_level="WARNING"),
                 _node_ip_address="127.0.0.1", dashboard_host="127.0.0.1",
                 runtime_env={"env_vars": {**EMBEDDED_ENV, **(worker_env or {})}})
        sigterm_as_interrupt()  # again: ray.init replaced it with its own (exit 1 / a C++ dump, no line)
        ray_started()
        return "embedded"
    target = _resolve_auto() if address == "auto" else address
    if _host_port(target) is None:
        raise KavaError(f"cannot connect to Ray at {address!r}: not host:port (or ray://host:port, auto)")
    if not answers(target):
        raise KavaError(f"cannot connect to Ray at {address!r}{_via(address, target)}: nothing answers within "
                        f"{PROBE_TIMEOUT_S:.0f} s (is the cluster up? `ray status --address {target}`)")
    kind = speaks(target)
    if kind != "grpc":
        what = {"http": "an HTTP server (the dashboard's port, 8265? Ray's address is the GCS port, 6379 by default)",
                "silent": f"a port that accepts connections but answers nothing within {PROBE_TIMEOUT_S:.0f} s",
                "other": "something that does not speak gRPC"}[kind]
        raise KavaError(f"cannot connect to Ray at {address!r}{_via(address, target)}: {what}, not a Ray cluster "
                        f"(`ray status --address {target}`)")
    if is_loopback(target):
        single_machine_mode()  # else Ray rewrites 127.0.0.1 to this machine's routable IP and never connects
    try:
        # Ray merges these with a `ray job submit` job's runtime env and refuses a key both set,
        # even to the same value: a key already in this driver's environment (the submitted job's
        # env_vars are) is left to it
        env = {k: v for k, v in TRAIN_ENV.items() if k not in os.environ}
        # "auto" goes to Ray as "auto" (it finds the same address): Ray then sends the token of
        # ~/.ray/auth_token to a cluster found that way even where RAY_AUTH_MODE is unset, as a bare
        # `ray start --head` (which turns token auth on when that file exists) needs; an explicit
        # address needs RAY_AUTH_MODE=token
        ray.init(address="auto" if address == "auto" else target, namespace=namespace, logging_level="WARNING",
                 log_to_driver=console.LOG_TO_DRIVER, runtime_env={"env_vars": env} if env else None)
    except (ConnectionError, RuntimeError, ValueError) as e:
        # something answers but refuses us: most often a token cluster and a client that sends no token
        hint = ("" if os.environ.get("RAY_AUTH_MODE") == "token" else
                " (a cluster started with RAY_AUTH_MODE=token needs it here too: export RAY_AUTH_MODE=token)")
        raise KavaError(f"cannot connect to Ray at {address!r}: {first_line(e)}{hint}") from None
    sigterm_as_interrupt()
    ray_started()
    return address


def _via(address: str, target: str) -> str:
    """` (from $RAY_ADDRESS)` / ` (HOST:PORT, from FILE)`: where an address the user did not type came from."""
    if os.environ.get("RAY_ADDRESS") == address:
        return " (from $RAY_ADDRESS)" if target == address else f" ({target}, from $RAY_ADDRESS)"
    if target != address:
        return f" ({target}, from {'$RAY_ADDRESS' if os.environ.get('RAY_ADDRESS') else ray_address_file()})"
    return ""


def disconnect(collect_logs: bool = True) -> None:
    """Leave Ray (`ray.shutdown()`, the one call of it): the quiet console copies Ray's logs first,
    which needs Ray up. collect_logs=False: a client of a cluster, whose workers' logs stay with the
    cluster."""
    if collect_logs:
        collect_before_shutdown()
    ray.shutdown()


@contextlib.contextmanager
def owned_ray(connected: str, client: bool = False) -> Iterator[str]:
    """Yield `connected` (what `connect` answered); on exit shut down the Ray it started
    ("embedded"). A Ray the caller had started ("existing") stays up. client=True: disconnect
    whatever Ray was joined (a command that only asks a cluster something; the cluster and its
    detached actors stay up)."""
    try:
        yield connected
    finally:
        if client or connected == "embedded":
            disconnect(collect_logs=not client)


def ray_session(address: Optional[str], namespace: str, client: bool = False, **kwargs):
    """`with ray_session(address, namespace, ...) as connected:` connected to Ray for the block
    (`connect`'s keyword arguments), then `owned_ray`'s shutdown rule."""
    return owned_ray(connect(address, namespace, **kwargs), client)


def resolve_use_gpu(use_gpu) -> bool:
    """`ray.use_gpu: auto` -> True when the cluster has GPUs, else False."""
    if use_gpu == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return bool(use_gpu)
