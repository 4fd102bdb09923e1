"""The vocabulary map between tokenizers (`kava_ray.core.align.vocab`), on the real SmolLM2, Qwen2 and Llama-3
tokenizers: a teacher id maps to the student id of the same string, one to one, and the map is cached."""

import numpy as np
import pytest

from kava_ray.core.align import vocab
from kava_ray.core.align.vocab import build_vocab_map, cached_vocab_map, token_keys

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def qwen_to_smol(smollm2_tokenizer, qwen2_tokenizer):
    return build_vocab_map(smollm2_tokenizer, qwen2_tokenizer)


def test_one_tokenizer_maps_every_id_to_itself(smollm2_tokenizer):
    m = build_vocab_map(smollm2_tokenizer, smollm2_tokenizer)
    assert np.array_equal(m.t2s, np.arange(len(smollm2_tokenizer))) and m.coverage == 1.0
    assert len(m.student_unmatched()) == 0


def test_a_teacher_token_maps_to_the_student_token_of_the_same_string(qwen_to_smol, smollm2_tokenizer,
                                                                     qwen2_tokenizer):
    """Words with their leading space, digits, punctuation and ChatML's specials: the same text on both sides
    (decoded); a token the student lacks (Qwen2's ' chmod', two tokens for SmolLM2) maps to nothing."""
    s_vocab, t_vocab = smollm2_tokenizer.get_vocab(), qwen2_tokenizer.get_vocab()
    for token in ("Ġthe", "Ġapples", "7", ".", "<|im_end|>", "<|im_start|>"):
        sid = qwen_to_smol.t2s[t_vocab[token]]
        assert sid == s_vocab[token], token
        assert smollm2_tokenizer.decode([sid]) == qwen2_tokenizer.decode([t_vocab[token]])
    assert qwen_to_smol.t2s[t_vocab["Ġchmod"]] == -1 and "Ġchmod" not in s_vocab
    # one to one, and every matched pair decodes to the same bytes (a random sample of them)
    hits = np.flatnonzero(qwen_to_smol.t2s >= 0)
    assert len(set(qwen_to_smol.t2s[hits].tolist())) == len(hits)
    s_keys, t_keys = token_keys(smollm2_tokenizer), token_keys(qwen2_tokenizer)
    for tid in np.random.default_rng(0).choice(hits, 300, replace=False):
        assert t_keys[int(tid)] == s_keys[int(qwen_to_smol.t2s[tid])]
    misses = np.flatnonzero(qwen_to_smol.t2s < 0)
    known = set(s_keys.values())
    assert not any(t_keys[int(t)] in known for t in misses[misses < len(t_keys)])
    # GOLD's matched weight: the share of the teacher's vocabulary that maps
    assert qwen_to_smol.coverage == pytest.approx(len(hits) / len(qwen2_tokenizer))


def test_coverage_of_the_real_pairs(qwen_to_smol, smollm2_tokenizer, llama3_tokenizer):
    """What the README reports: a larger teacher vocabulary maps a smaller share of itself, yet covers most of a
    small student's vocabulary (SmolLM2's 49k, most of them common English pieces the others have too)."""
    llama_to_smol = build_vocab_map(smollm2_tokenizer, llama3_tokenizer)
    for m in (qwen_to_smol, llama_to_smol):
        assert 0.2 < m.coverage < 0.4 and 0.75 < m.student_coverage < 0.9, m.summary()
    print(qwen_to_smol.summary(), llama_to_smol.summary(), sep="\n")


def test_the_map_is_built_once_and_read_from_its_cache(tmp_path, monkeypatch, smollm2_tokenizer, qwen2_tokenizer,
                                                       qwen_to_smol):
    first = cached_vocab_map(smollm2_tokenizer, qwen2_tokenizer, "t" * 20, "s" * 20, tmp_path / "maps")
    assert np.array_equal(first.t2s, qwen_to_smol.t2s) and (tmp_path / "maps" / first.file_name).is_file()
    monkeypatch.setattr(vocab, "build_vocab_map", lambda *a, **k: pytest.fail("built again"))
    again = cached_vocab_map(smollm2_tokenizer, qwen2_tokenizer, "t" * 20, "s" * 20, tmp_path / "other",
                             also_in=(tmp_path / "maps",))
    assert np.array_equal(again.t2s, first.t2s) and not (tmp_path / "other").exists()
    assert not list((tmp_path / "maps").glob(".*tmp"))  # written through a temp file, renamed


def test_bench_vocab_reports_every_ordered_pair_on_both_corpora():
    from kava_ray.bench.vocab import format_vocab_bench, run_vocab_bench

    r = run_vocab_bench(names=("smollm2", "qwen2"), docs=2, problems=4, max_length=128)
    assert [(p["teacher"], p["student"]) for p in r["pairs"]] == [("qwen2", "smollm2"), ("smollm2", "qwen2")]
    for p in r["pairs"]:
        for c in r["config"]["corpora"]:
            # a pair needs both tokenizations to end together: never more positions than the KV alignment covers
            assert 0.3 < p[c]["paired"] <= p[c]["kv"] <= 1.0 and p[c]["student_tokens"] > 100, (p, c)
    assert r["pairs"][0]["map"]["coverage"] == pytest.approx(r["pairs"][1]["map"]["student_coverage"])
    assert "qwen2 -> smollm2" in format_vocab_bench(r)


def test_hybrid_through_the_real_identity_map_is_the_same_tokenizer_kd(smollm2_tokenizer):
    """SmolLM2 teaching SmolLM2 through the map built from its real vocabulary: nothing is unmatched, GOLD's matched
    weight is 1, and the hybrid loss is the top-k KD (`losses.topk_kl_loss`) to float rounding."""
    import torch

    from kava_ray.core.losses import hybrid_logit_loss, topk_kl_loss

    m = build_vocab_map(smollm2_tokenizer, smollm2_tokenizer)
    g = torch.Generator().manual_seed(0)
    student = torch.randn(1, 4, len(m.t2s), generator=g)
    logp_full = (torch.randn(1, 4, len(m.t2s), generator=g) * 3).log_softmax(-1)
    logp, ids = logp_full.topk(32, dim=-1)
    tail = logp_full.scatter(-1, ids, float("-inf")).logsumexp(-1)
    loss, parts = hybrid_logit_loss(student, ids, logp, torch.from_numpy(m.t2s),
                                    torch.from_numpy(m.student_unmatched()),
                                    teacher_tail=tail, matched_weight=m.coverage)
    assert m.coverage == 1.0 and float(parts["uld"]) == 0.0
    assert float(loss) == pytest.approx(float(topk_kl_loss(student, ids, logp, teacher_tail=tail)), rel=1e-6)
