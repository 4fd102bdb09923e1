"""The names of the step's metrics, defined once: the Distiller and the losses make them, the recipe
sums or averages them, evaluation, the report and the trackers read them (metrics.jsonl keys)."""

from __future__ import annotations

LOSS, CE, KV_LOSS = "loss", "ce", "kv_loss"
COS_SIM = "cos_sim"  # centred per (layer, head) over the batch's counted tokens: a constant target scores 0
COS_RAW = "cos_raw"  # the plain cosine (flattered by constants)
COS_LAYERS = ("cos_layer/first", "cos_layer/middle", "cos_layer/last")  # centred, at those student layers
CONTRAST_GAP = "contrast_gap"
HIDDEN = "hidden_loss"  # Minitron's hidden-state cosine term (loss.hidden_weight), weighted over teachers
RELATION = "relation_loss"  # the MiniLMv2 relation term (loss.relation_weight), weighted over teachers
LOGIT_KL = "logit_kl"  # the logit KD loss, weighted over teachers
TOKENS, KV_TOKENS, LABEL_TOKENS = "tokens", "kv_tokens", "label_tokens"  # real / KV-counted / next-token positions
GRAD_KV_SHARE = "grad/kv_share"  # |grad of kv_weight * KV on the student| / |the whole loss's| (log steps)
GRAD_KV_RATIO = "grad/kv_ratio"  # |grad of kv_weight * KV on the student| / |every other term's| (log steps)
SKIPPED_BATCHES = "skipped_batches"  # batches dropped for non-finite teacher KV (the recipe's count)
SAMPLED_TOKENS = "onpolicy/sampled_tokens"  # completion tokens the student sampled in the step (on-policy)
EVALS = "evals"  # in Tune reports only: evaluations made after step 0 (the ASHA scheduler's clock)
SAMPLE_S = "time/sample_s"  # seconds the step spent sampling (on-policy; mean over ranks)
TEACHER_WAIT_S = "teacher_wait_s"  # seconds the step waited for its teachers' KV (mean over ranks)
# the teacher-scored per-token reverse KL of the student's samples, log q - log pi_T (tinker's
# teacher_kl), per teacher of its tokenizer: summed over sampled tokens as RKL_SUM/<t>, divided by
# SAMPLED_TOKENS into RKL/<t>
RKL, RKL_SUM = "onpolicy/reverse_kl", "onpolicy/reverse_kl_sum"
SUMMED = (TOKENS, KV_TOKENS, LABEL_TOKENS, SKIPPED_BATCHES, SAMPLED_TOKENS)  # summed over micro-batches and ranks
# (and every RKL_SUM/<t>: `summed`); the rest: means


def summed(name: str) -> bool:
    """Whether a metric is summed over micro-batches and ranks (a count) rather than averaged."""
    return name in SUMMED or name.startswith(RKL_SUM + "/")

# per teacher, as `of(COS, teacher)`: cos/<t> (centred), cos_raw/<t>, aligned/<t> (the share of KV
# positions a teacher of another tokenizer covers), fusion/<t> (its fusion weight), top1_agree/<t>,
# and the logit terms logit_kl/<t>, logit_uld/<t>, logit_aligned/<t>
COS, ALIGNED, FUSION, TOP1_AGREE = "cos", "aligned", "fusion", "top1_agree"
LOGIT_PER_TEACHER = ("logit_kl/", "logit_uld/", "logit_aligned/", "top1_agree/")  # per next-token position

# train.eval_tasks (kava_ray.recipes.harness): eval/task/<task>/<metric> at each evaluation, and the seconds it took
TASK_PREFIX, EVAL_TASKS_S = "eval/task/", "eval/tasks_s"

_PHASES = [(0.5, "Adapting"), (0.7, "Learning"), (0.9, "Good"), (0.95, "Great")]


def of(name: str, teacher: str) -> str:
    """A per-teacher metric's name: `cos/<teacher>`."""
    return f"{name}/{teacher}"


def phase(cos: float) -> str:
    """Training phase name for the centred mean KV cosine (`cos_sim`; a constant projector scores
    ~0: "Adapting"). Never pass `cos_raw`: a constant per (layer, head) reaches ~0.88 on real
    keys."""
    return next((name for limit, name in _PHASES if cos < limit), "Excellent")
