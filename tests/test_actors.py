"""Teacher pool on a local Ray: two tiny teachers of different geometry (one NF4) serving KV."""

import subprocess
import sys

import numpy as np
import pytest
import ray
import torch

from actors.kv_cache import CacheSource, KVCache
from actors.pool import find_pool, missing_replicas, start_missing, start_pool, stop_pool
from kava_ray.common.config import load_config
from kava_ray.common.errors import KavaError
from kava_ray.core.kv import KVBatch, teacher_forward_kv
from kava_ray.core.models import load_model
from kava_ray.core.plans import student_geometry, student_tokenizer, teacher_plans
from kava_ray.data import BatchStream
from kava_ray.data.splits import load_splits
from kava_ray.rollout.feed import ActorSource, KVFeed, feed_items, get_kv
from kava_ray.runtime.job import teacher_geometries


@pytest.fixture(scope="module")
def pool(tiny_pool, tiny_job):
    """The session's pool with a second replica of the NF4 llama, which this module stops again."""
    cfg = load_config(tiny_job, ["teachers.1.replicas=2"])
    handles, started = start_missing(cfg)
    assert started == ["llama#1"]
    yield cfg, handles
    stop_pool(cfg, only=started)


@pytest.fixture(scope="module")
def references(pool):
    """The same teachers loaded in this process (1 thread, as in the actors)."""
    cfg, _ = pool
    return {t.name: load_model(t.model, dtype=t.dtype, quantization=t.quantization) for t in cfg.teachers}


def batches(cfg, n, seed=None, batch_size=None):
    tok, _ = student_tokenizer(cfg.student)
    train, _ = load_splits(cfg.data, cfg.train, tok)
    stream = BatchStream(train, batch_size or cfg.train.batch_size, cfg.train.seed if seed is None else seed)
    return list(feed_items(stream, n))


def canonical_batches(cfg, n):
    """The first n batches as `teachers precompute` runs them (consecutive examples of the training split):
    what a cached example was computed in, so live and cached answers are bit-equal."""
    from kava_ray.data import collate_split
    from kava_ray.rollout.feed import request_arrays

    tok, _ = student_tokenizer(cfg.student)
    train, _ = load_splits(cfg.data, cfg.train, tok)
    B = cfg.train.batch_size
    out = []
    for s in range(0, n * B, B):
        idx = list(range(s, s + B))
        ids, mask = request_arrays(collate_split(train, idx))
        out.append((f"canonical/{s}", ids, mask, None, (train.fingerprint, tuple(idx))))
    return out


def local_kv(model, ids, mask, layers):
    torch.set_num_threads(1)
    kv = teacher_forward_kv(model, torch.as_tensor(ids), torch.as_tensor(mask), layers=layers)
    return kv.to(dtype=torch.bfloat16)


def test_served_kv_equals_in_process_extraction_bit_exact(pool, references):
    cfg, handles = pool
    (key, ids, mask, *_), = batches(cfg, 1)
    geoms = {n: ray.get(h.geometry.remote()) for n, h in handles.items()}
    assert (geoms["qwen"]["num_layers"], geoms["qwen"]["head_dim"]) == (4, 16)
    assert (geoms["llama"]["num_layers"], geoms["llama"]["head_dim"]) == (3, 32)
    assert geoms["qwen"]["tokenizer_fingerprint"] == geoms["llama"]["tokenizer_fingerprint"]
    for name, layers in (("qwen", [0, 3]), ("llama", [2])):
        payload = get_kv(handles[name].kv.remote(None, ids, mask, layers, "bf16"))
        served = KVBatch.from_wire(payload, dtype=None)
        ref = local_kv(references[name], ids, mask, layers)
        assert served.layer_ids == layers and served.keys.dtype == torch.bfloat16
        assert torch.equal(served.keys, ref.keys) and torch.equal(served.values, ref.values)
        assert torch.equal(served.mask.long(), torch.as_tensor(mask).long())


def test_two_consumers_same_key_cost_one_forward(pool):
    import ray

    cfg, handles = pool
    h = handles["qwen"]
    (key, ids, mask, *_), = batches(cfg, 1)
    before = ray.get(h.stats.remote())
    answers = ray.get([h.kv.remote(key + "/dedup", ids, mask, [0, 1], "bf16"),
                       h.kv.remote(key + "/dedup", ids, mask, [0, 1], "bf16")])
    after = ray.get(h.stats.remote())
    assert after["forwards"] - before["forwards"] == 1
    assert after["hits"] - before["hits"] == 1 and after["requests"] - before["requests"] == 2
    # the hit hands out the object the miss put into the store: no second copy
    assert isinstance(answers[0], ray.ObjectRef) and answers[0] == answers[1]
    a, b = get_kv(answers)
    assert np.array_equal(a["k"], b["k"])


def test_replicas_spread_batches_and_two_consumers_of_a_batch_cost_one_forward(pool, references):
    """A 2-replica teacher: two consumers (two Tune trials' feeds) reading the same keyed batches get every batch
    in order, bit-equal to the in-process forward; consecutive batches alternate replicas, and each batch costs one
    forward in all (the second consumer hits the LRU of the replica its key routes to)."""
    from actors.pool import pool_status

    cfg, handles = pool
    llama = handles["llama"]
    assert len(llama) == 2 and len(handles["qwen"]) == 1
    assert len({ray.get(h.geometry.remote())["pid"] for h in llama.handles}) == 2  # two processes
    items = [(key + "/replicas", ids, mask, item) for key, ids, mask, item, _ in batches(cfg, 4)]
    before = [ray.get(h.stats.remote()) for h in llama.handles]
    first = list(KVFeed(ActorSource(handles), iter(items), {"llama": [0, 2]}, depth=2))
    second = list(KVFeed(ActorSource(find_pool(cfg, ["llama"])), iter(items), {"llama": [0, 2]}, depth=2))
    after = [ray.get(h.stats.remote()) for h in llama.handles]
    forwards = [a["forwards"] - b["forwards"] for a, b in zip(after, before)]
    hits = [a["hits"] - b["hits"] for a, b in zip(after, before)]
    assert forwards == [2, 2] and hits == [2, 2], (forwards, hits)  # batch index mod 2; one forward per batch
    for (key, ids, mask, *_), (i1, a), (i2, b) in zip(items, first, second):
        assert i1[0] == i2[0] == key[:-len("/replicas")]  # in the feed's order
        ref = local_kv(references["llama"], ids, mask, [0, 2])
        assert torch.equal(a["llama"].keys.to(torch.bfloat16), ref.keys)
        assert torch.equal(a["llama"].keys, b["llama"].keys) and torch.equal(a["llama"].values, b["llama"].values)
    rows = {r["name"]: r for r in pool_status(cfg)}  # `kava-ray teachers status`: one row per replica
    assert {"qwen", "llama", "llama#1"} <= set(rows) and rows["llama#1"]["running"]
    assert rows["llama#1"]["forwards"] == after[1]["forwards"]


def test_killed_teacher_restarts_and_feed_delivers_every_batch_in_order(pool, references):
    import ray

    cfg, handles = pool
    items = batches(cfg, 6)
    layers = {"qwen": [1, 2], "llama": [0]}
    feed = KVFeed(ActorSource(handles, retry_wait_s=0.5), iter(items), layers, depth=2)
    got = []
    for i, (item, kv) in enumerate(feed):
        got.append((item[0], kv))
        if i == 1:  # requests for batches 2 and 3 are in flight
            ray.kill(handles["qwen"].handles[0], no_restart=False)
    assert [k for k, _ in got] == [it[0] for it in items]  # every batch, in order
    for (key, ids, mask, *_), (_, kv) in zip(items, got):
        for name in layers:
            ref = local_kv(references[name], ids, mask, layers[name])
            assert torch.equal(kv[name].keys.to(torch.bfloat16), ref.keys), (key, name)
    assert ray.get(handles["qwen"].stats.remote())["restarted"] is True
    assert len(feed.wait_s) == 6
    from actors.pool import pool_status

    status = {r["name"]: r for r in pool_status(cfg)}  # what `kava-ray teachers status` prints
    assert status["qwen"]["restarts"] >= 1 and status["llama"]["restarts"] == 0, status


def test_precompute_then_cache_equals_live_and_detects_corruption(pool, tmp_path):
    """Every example once, read back in any batch composition: bit-equal to the live teachers on the batches
    it was computed in, equal to the bf16 rounding on a reshuffled stream of another seed and batch size."""
    from actors.kv_cache import example_key
    from kava_ray.runtime.job import precompute

    cfg, handles = pool
    out = tmp_path / "kvcache"
    stats = precompute(cfg, out, progress=False)
    sizes = (cfg.data.num_train, cfg.data.num_val, cfg.data.num_test)  # train, validation, test
    assert stats["written"] == stats["total"] == sum(sizes) and stats["skipped"] == 0
    assert stats["forwards"] == sum(-(-n // cfg.train.batch_size) for n in sizes)  # each example once
    again = precompute(cfg, out, progress=False)  # resumes: nothing left to do
    assert again["written"] == again["forwards"] == 0 and again["skipped"] == stats["total"]

    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, teacher_geometries(handles),
                          student_geometry(cfg.student))
    layers = {n: p.layers for n, p in plans.items()}
    def real(kv, mask):  # padding carries whatever the forward put there live, zeros from the cache
        m = torch.as_tensor(mask).bool()[None, :, None, :, None]
        return kv.keys * m, kv.values * m

    items = canonical_batches(cfg, 3)
    cached = list(KVFeed(CacheSource(KVCache(out)), iter(items), layers, depth=2))
    live = list(KVFeed(ActorSource(handles), iter(items), layers, depth=2))
    for item, (_, kc), (_, kl) in zip(items, cached, live):
        for n in layers:
            assert all(torch.equal(a, b) for a, b in zip(real(kc[n], item[2]), real(kl[n], item[2])))
    # another data seed and batch size: the same examples in other batches, assembled from the cache
    other = batches(cfg, 4, seed=7, batch_size=3)
    cached = list(KVFeed(CacheSource(KVCache(out)), iter(other), layers, depth=2))
    live = list(KVFeed(ActorSource(handles), iter(other), layers, depth=2))
    assert len(cached) == 4
    for item, (_, kc), (_, kl) in zip(other, cached, live):
        for n in layers:  # other padding, other matmul shapes: equal to one bf16 rounding step
            for a, b in zip(real(kc[n], item[2]), real(kl[n], item[2])):
                assert a.shape == b.shape and torch.allclose(a, b, rtol=2 ** -7, atol=1e-3)

    cache = KVCache(out)
    fp, idx = other[1][4]
    shard = out / cache.shards[example_key(fp, idx[0])]["file"]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(KavaError, match=f"{shard.name}.*checksum mismatch"):
        list(KVFeed(CacheSource(KVCache(out)), iter(other), layers, depth=1))
    # a cache written for another layer set is refused by name
    with pytest.raises(KavaError, match="teachers"):
        KVCache(out, dict(cache.meta, teachers={}))


# ------------------------------------------------------------------------------- teacher logits (top-k)


def logit_job(base, k, monkeypatch, extra=()):
    """The job with loss.logit_weight > 0 and loss.logit_top_k = k (or, on a LossConfig without the logit
    loss, the job's one rule for k patched)."""
    try:
        return load_config(base, ["loss.logit_weight=1", f"loss.logit_top_k={k}", *extra])
    except KavaError:
        monkeypatch.setattr("kava_ray.core.plans.logits_top_k", lambda cfg: k)
        return load_config(base, list(extra))


def test_served_logits_equal_in_process_and_one_forward_serves_two_consumers(pool, references):
    """Top-k log-probs from the teacher's KV forward: equal to the in-process forward's (ids exactly, log-probs
    to the bf16 wire rounding: the wire has no fp32); two consumers of one batch with one k share one forward."""
    cfg, handles = pool
    h = handles["qwen"]
    (key, ids, mask, *_), = batches(cfg, 1)
    before = ray.get(h.stats.remote())
    a, b = get_kv([h.kv.remote(key + "/logits", ids, mask, [0, 3], "bf16", 8),
                    h.kv.remote(key + "/logits", ids, mask, [0, 3], "bf16", 8)])
    after = ray.get(h.stats.remote())
    assert after["forwards"] - before["forwards"] == 1 and after["hits"] - before["hits"] == 1
    assert after["requests"] - before["requests"] == 2
    B, T = ids.shape
    assert after["logit_bytes_served"] - before["logit_bytes_served"] == 2 * B * T * (8 * (4 + 2) + 4)  # + the tail
    assert np.array_equal(a["topk_ids"], b["topk_ids"]) and np.array_equal(a["topk_logp"], b["topk_logp"])
    served = KVBatch.from_wire(a)
    torch.set_num_threads(1)
    ref = teacher_forward_kv(references["qwen"], torch.as_tensor(ids), torch.as_tensor(mask), layers=[0, 3],
                             logits_top_k=8)
    assert torch.equal(served.topk_ids, ref.topk_ids)
    assert torch.equal(served.topk_logp, ref.topk_logp.to(torch.bfloat16).float())  # the one bf16 rounding
    assert torch.allclose(served.topk_logp, ref.topk_logp, rtol=2 ** -8, atol=1e-5)
    assert torch.equal(served.keys, ref.keys.to(torch.bfloat16).float())
    # k = 0 on the same key: its own LRU entry (today's key) and today's payload, no logits
    c = get_kv(h.kv.remote(key + "/logits", ids, mask, [0, 3], "bf16"))
    assert "topk_ids" not in c and ray.get(h.stats.remote())["forwards"] - after["forwards"] == 1
    assert np.array_equal(c["k"], a["k"])


def test_precompute_caches_logits_exactly_and_a_cache_without_logits_is_refused(pool, tmp_path, monkeypatch):
    from kava_ray.runtime.job import kv_source, precompute, setup_teachers

    _, handles = pool
    cfg = logit_job(pool[0], 4, monkeypatch)
    out = tmp_path / "kvcache-logits"
    stats = precompute(cfg, out, progress=False)
    assert stats["written"] == stats["total"] > 0
    cache = KVCache(out)
    assert cache.meta["logits_top_k"] == 4
    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, teacher_geometries(handles),
                          student_geometry(cfg.student))
    layers = {n: p.layers for n, p in plans.items()}
    items = canonical_batches(cfg, 2)
    cached = list(KVFeed(CacheSource(cache), iter(items), layers, decode=False, logits_top_k=4))
    live = list(KVFeed(ActorSource(handles), iter(items), layers, decode=False, logits_top_k=4))
    for item, (_, pc), (_, pl) in zip(items, cached, live):
        m = torch.as_tensor(item[2]).bool()  # the real positions (padding: zeros in the cache)
        for n in layers:  # bit-exact round trip of KV and logits through the shards
            assert pc[n]["topk_ids"].shape[-1] == 4
            for arr in ("k", "v", "topk_ids", "topk_logp", "topk_tail"):
                assert pc[n][arr].dtype == pl[n][arr].dtype and pc[n][arr].shape == pl[n][arr].shape, (n, arr)
            c, live_kv = KVBatch.from_wire(pc[n], dtype=None), KVBatch.from_wire(pl[n], dtype=None)
            for x, y in ((c.keys, live_kv.keys), (c.values, live_kv.values)):
                assert torch.equal(x.transpose(2, 3)[:, m], y.transpose(2, 3)[:, m]), n
            for x, y in ((c.topk_ids, live_kv.topk_ids), (c.topk_logp, live_kv.topk_logp),
                         (c.topk_tail, live_kv.topk_tail)):
                assert torch.equal(x[m], y[m]), n
    # a job without logits reads it and gets today's payloads
    (_, plain), = list(KVFeed(CacheSource(cache), iter(items[:1]), layers, decode=False))
    assert all("topk_ids" not in p for p in plain.values())
    # another k: refused per batch, in one line
    with pytest.raises(KavaError, match="top-4 logits, the job wants top-8") as info:
        list(KVFeed(CacheSource(cache), iter(items[:1]), layers, logits_top_k=8))
    assert "\n" not in str(info.value)

    # a cache written without logits, for a job that needs them: refused in one line
    bare_dir = tmp_path / "kvcache-bare"
    KVCache(bare_dir, {k: v for k, v in cache.meta.items() if k != "logits_top_k"}, create=True)
    job = logit_job(pool[0], 4, monkeypatch, ["data.kv_source=cache", f"data.kv_cache_dir={bare_dir}"])
    for attempt in (lambda: setup_teachers(job), lambda: kv_source(job, plans, cache.meta["data"])):
        with pytest.raises(KavaError, match="written without teacher logits; this job needs top-4") as info:
            attempt()
        assert "\n" not in str(info.value)


def test_a_cached_top_k_past_the_teachers_vocabulary_is_all_of_it():
    """`loss.logit_top_k` >= V: the teacher serves its V ids (`teacher_forward_kv` clamps k), so a cached payload of
    V ids answers such a job (the cache's geometry gives V); a payload of another k is still refused in one line."""
    from types import SimpleNamespace

    from actors.kv_cache import _check_payload

    def request(k):
        return SimpleNamespace(key="b0", layers=[0], wire_dtype="bf16", logits_top_k=k, hidden=False)

    payload = {"layer_ids": [0], "dtype": "bf16", "topk_ids": np.zeros((1, 2, 50), dtype=np.int32)}
    _check_payload("cache", "t", request(10**6), payload, vocab=50)
    _check_payload("cache", "t", request(50), payload, vocab=50)
    with pytest.raises(KavaError, match="has top-50 logits, the job wants top-64"):
        _check_payload("cache", "t", request(64), payload, vocab=100)
    with pytest.raises(KavaError, match="has top-50 logits, the job wants top-1000000"):
        _check_payload("cache", "t", request(10**6), payload)  # (no geometry: no clamp)


def test_logits_take_a_padded_head_and_need_a_teacher_that_gives_them(tiny_job, monkeypatch):
    from dataclasses import replace

    from kava_ray.core.plans import TeacherPlan, check_vocab, logit_specs, logit_teachers

    s_geom = student_geometry(load_config(tiny_job).student)
    plans = {n: TeacherPlan(n, s_geom, [], []) for n in ("qwen", "llama")}
    # the student's tokenizer, a wider LM head (Qwen2.5-7B's 152,064 rows against 1.5B's 151,936): its logits count
    bigger = dict(plans, llama=replace(plans["llama"], geometry=replace(s_geom, vocab_size=s_geom.vocab_size + 128)))
    check_vocab(load_config(tiny_job).loss, bigger)  # no logits asked for: nothing to check
    cfg = logit_job(tiny_job, 4, monkeypatch)
    check_vocab(cfg.loss, plans)
    check_vocab(cfg.loss, bigger)
    specs = logit_specs(cfg.loss, bigger)
    assert (specs["llama"].cross, specs["llama"].vocab_size) == (None, s_geom.vocab_size + 128)
    # a teacher of another tokenizer: its vocabulary is not checked (it is mapped), its logits are used unless
    # loss.logit_cross_vocab is off (then a job with only such teachers is refused)
    other = dict(bigger, llama=replace(bigger["llama"], tokenizer="elsewhere", tokenizer_fingerprint="x"))
    check_vocab(cfg.loss, other)
    assert logit_teachers(cfg.loss, other) == ["qwen", "llama"]
    off = logit_job(tiny_job, 4, monkeypatch, ["loss.logit_cross_vocab=off"])
    assert logit_teachers(off.loss, other) == ["qwen"]
    with pytest.raises(KavaError, match="no teacher shares the student's tokenizer") as info:
        check_vocab(off.loss, {"llama": other["llama"]})
    assert "\n" not in str(info.value)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "kava_ray.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("extra,expect", [
    (["--teacher", "nope"], "unknown teacher 'nope'"),
    (["teachers.0.model=/no/such/model"], "model '/no/such/model'"),
    (["teachers.0.num_gpus=2"], "asks for 2 GPUs but the cluster has 0"),
], ids=["unknown-teacher", "unloadable-model", "too-many-gpus"])
def test_teachers_bad_input_is_one_line_exit_2(ray_session, tiny_job, extra, expect):
    import ray

    addr = ray.get_runtime_context().gcs_address
    r = cli("teachers", "up", "--config", str(tiny_job), "--address", addr, "ray.namespace=kava-bad", *extra)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and expect in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_bench_feed_runs_every_mode_and_reports_ratios(ray_session, tmp_path):
    """Every part of `kava-ray bench feed` at toy sizes: a timed regime, replicas, the real teacher, early stop and
    transport (one size of each: every actor is a process start). Asserts what the bench computes, never how
    fast this box was."""
    from kava_ray.bench.feed import format_feed_bench, run_feed_bench

    r = run_feed_bench(steps=3, batch=2, tokens=16, depths=(1, 2), ratios=(2.0,), teacher_counts=(1,),
                       replicas=(2,), replica_steps=4, real_layers=(2,), transport_mib=2, repeats=2,
                       # on a cluster of its own: tests/test_multinode.py
                       cross_node=False, transport_warmup_bytes=2**25)
    regimes = r["regimes"]
    assert [(g["mode"], g["teachers"]) for g in regimes] == [("timed", 1), ("real", 1)]
    for g in regimes:
        assert set(g["pipelined_s"]) == {"1", "2"} and all(v > 0 for v in g["pipelined_s"].values())
        best = max(max(g["T_s"]), g["S_s"])
        assert g["efficiency"]["2"] == pytest.approx(best / g["pipelined_s"]["2"])
        if g["mode"] == "timed":  # each teacher waits its delay at least: T/S and its speed step of the slowest
            target = [g["t_over_s_target"] * g["S_s"] * f for f in r["config"]["speed_steps"][:g["teachers"]]]
            assert all(t >= 0.99 * d for t, d in zip(g["T_s"], target)), (g["T_s"], target)
    assert [x["replicas"] for x in r["replicas"]] == [2] and r["replicas"][0]["depth"] == 4
    assert r["replicas"][0]["forwards_per_replica"] == [2, 2]  # batch keys alternate replicas, one forward each
    e = r["early_stop"]
    assert e["served_layers"] == [0, 1, 2, 3] and e["full_ms"] > 0 and e["stopped_ms"] > 0
    t = r["transport"]
    assert t["bytes"] >= 2 * 2**20 * 0.9 and t["wire_over_pickle"] > 0 and t["wire_first_Bps"] > 0
    assert t["put_first_faults"] >= t["put_steady_faults"] >= 0 and t["warmup_bytes"] >= 10 * t["bytes"]
    text = format_feed_bench(r)
    assert "replica scaling" in text and "real 1 (2 layers)" in text and "timed 1" in text
    # `kava-ray bench all` writes these figures into docs/results.md, each row naming its command
    from kava_ray.bench.all import PERF_BEGIN, PERF_END, performance_block, summary_rows, write_results

    rows = summary_rows({"feed": r})
    assert rows and all(row[-1] == "`kava-ray bench feed`" for row in rows)
    assert any(f"{r['replicas'][0]['step_over_expected']:.2f}" in row[1] for row in rows)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{PERF_BEGIN}\nold\n{PERF_END}\n\n## after\n")
    write_results(readme, performance_block({"feed": r, "wall_s": {"feed": 60.0}}, "a test box"))
    out = readme.read_text()
    assert "old" not in out and out.startswith("# x") and out.endswith("## after\n") and "replica scaling" in out
    assert out.count(PERF_BEGIN) == out.count(PERF_END) == 1 and "| figure | measured | target | regenerate |" in out


@pytest.mark.parametrize("override,field", [("teachers.0.model={student}", "model"),
                                            ("teachers.1.quantization=none", "quantization"),
                                            ("align.key_space=post_rope", "key_space")])
def test_a_running_pool_of_another_config_is_refused(pool, tiny_job, tiny_student_dir, tmp_path, capsys, override,
                                                      field):
    """A pool is found by name; a train whose teachers differ from it fails in one line naming the field,
    exit 2, before any training starts (no metrics, no checkpoint)."""
    from kava_ray.cli import main

    cfg, _ = pool
    storage = tmp_path / "runs"
    args = ["train", "--config", str(tiny_job), override.format(student=tiny_student_dir),
            f"ray.storage_path={storage}"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: running teacher") and f"{field}=" in err[0], err
    assert "--restart-teachers" in err[0]
    # nothing trained: the run dir holds only the driver's logs of the refused start
    assert not list(storage.glob("*/metrics.jsonl")) and not list(storage.glob("*/checkpoint_*"))


def test_a_command_stops_only_the_teachers_it_started(pool, tiny_job):
    """A job whose pool is partly running (a second qwen replica is not): `job_teachers` starts only that
    replica and, on exit, stops only it; what was running before stays up."""
    from kava_ray.runtime.job import job_teachers

    def running_ids():  # the actor ids of the pool this module runs
        return {n: [h._actor_id for h in hs.handles] for n, hs in find_pool(load_config(tiny_job)).items()}

    cfg = load_config(tiny_job, ["teachers.0.replicas=2"])
    before = running_ids()
    with job_teachers(cfg) as job:
        assert job.started == ["qwen#1"] and len(job.handles["qwen"].handles) == 2
    assert missing_replicas(cfg) == ["qwen#1"]
    assert running_ids() == before


def test_restart_teachers_replaces_a_mismatched_pool(ray_session, tiny_job):
    """--restart-teachers: a running teacher started for another config (here: post-RoPE keys) is replaced by
    one started for this config, which the command then owns (in a namespace of its own: the session's pool
    stays as it is)."""
    from kava_ray.runtime.job import setup_teachers, teacher_geometries

    cfg = load_config(tiny_job, ["ray.namespace=kava-restart"])
    cfg = cfg.model_copy(update={"teachers": cfg.teachers[:1]})  # qwen alone
    old = start_pool(cfg)  # held: Ray ends a non-detached actor once no handle to it is left
    try:
        post = cfg.model_copy(update={"align": cfg.align.model_copy(update={"key_space": "post_rope"})})
        new, _, started = setup_teachers(post, restart=True)
        assert started == ["qwen"] and teacher_geometries(new)["qwen"]["key_space"] == "post_rope"
        assert new["qwen"].handles[0]._actor_id != old["qwen"].handles[0]._actor_id
    finally:
        stop_pool(cfg)


def test_a_running_teacher_is_checked_against_its_weights_by_content_on_its_node(ray_session, tiny_job, tmp_path,
                                                                                  tiny_qwen2_dir):
    """The weights a running teacher loaded are compared with what its model path holds now, read by the teacher on
    its own node, by content: the same bytes written again (another copy, another mtime) pass; other weights at
    the path are one line naming the node."""
    import shutil

    from kava_ray.runtime.job import identity_mismatch, teacher_weights
    from kava_ray.testing.tiny import build_tiny_model

    model = tmp_path / "qwen"
    shutil.copytree(tiny_qwen2_dir, model)
    cfg = load_config(tiny_job, ["ray.namespace=kava-identity", f"teachers.0.model={model}"])
    cfg = cfg.model_copy(update={"teachers": cfg.teachers[:1]})  # qwen alone
    handles = start_pool(cfg)
    try:
        def check():
            return identity_mismatch(cfg, teacher_geometries(handles), teacher_weights(handles))

        assert check() is None
        for f in model.iterdir():  # a copy of the same weights: new files, new mtimes, same bytes
            data = f.read_bytes()
            f.unlink()
            f.write_bytes(data)
        assert check() is None
        other = build_tiny_model(tmp_path / "other", family="qwen2", num_layers=4, hidden_size=64, num_heads=4,
                                 num_kv_heads=2, seed=7)
        shutil.copy(other / "model.safetensors", model / "model.safetensors")
        assert check() == (f"running teacher 'qwen' (node 127.0.0.1) loaded other weights than {str(model)!r} holds "
                           f"there now (rewritten since?)")
    finally:
        stop_pool(cfg)


def test_replicas_that_loaded_different_copies_are_refused(tiny_job):
    """Replicas on nodes whose copies of the model differ: one line naming the replicas' nodes."""
    from kava_ray.runtime.job import identity_mismatch

    cfg = load_config(tiny_job)
    t = cfg.teachers[0]
    geoms = {x.name: {"model": x.model, "quantization": x.quantization, "requested_dtype": x.dtype,
                      "key_space": cfg.align.key_space} for x in cfg.teachers}
    same = [{"loaded": "a1", "now": "a1", "node": "10.0.0.1"}, {"loaded": "a1", "now": "a1", "node": "10.0.0.2"}]
    others = {x.name: [] for x in cfg.teachers}  # the other teachers: no replica reported
    assert identity_mismatch(cfg, geoms, others | {t.name: same}) is None
    differ = [same[0], {"loaded": "b2", "now": "b2", "node": "10.0.0.2"}]
    assert identity_mismatch(cfg, geoms, others | {t.name: differ}) == (
        f"teacher '{t.name}': its replicas loaded different weights from {t.model!r} (replica 0 on node 10.0.0.1, "
        f"replica 1 on node 10.0.0.2): the copies on those nodes differ")
