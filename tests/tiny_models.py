"""Test helpers: the tiny models live in the package (`kava_ray.testing`), benches use them too."""

from kava_ray.testing.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_model, build_tokenizer  # noqa: F401
from kava_ray.testing.tiny_gguf import write_tiny_gguf  # noqa: F401


def train_on_one_batch(distiller, optim_cfg, batch, kv, steps: int) -> list[dict]:
    """`steps` optimizer steps of a Distiller (its production optimizer) on one batch and its teacher KV; the
    metrics of each step, as the Distiller returns them (detached 0-d tensors)."""
    from kava_ray.core.distiller import build_optimizer

    opt = build_optimizer(distiller, optim_cfg)
    history = []
    for _ in range(steps):
        out = distiller(batch, kv)
        loss, m = out.loss, out.metrics
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(m)
    return history


def logit_term(lt, logits, t, batch, mask, loss_cfg, lse=None):
    """(loss, metrics) of one logit teacher on whole logits [B, T_s, V] at the next-token positions `mask`:
    `logit_kd.logit_targets` then `targets_term`, as `Distiller._vocab_terms` reads them on one chunk (a test's
    reference: the product reads through `logit_kd.VocabTerms`)."""
    from kava_ray.core.logit_kd import logit_targets, targets_term

    tg, fixed = logit_targets(lt, t, batch, mask, loss_cfg, logits.shape[-1], logits.device)
    loss, metrics = targets_term(lt, logits, tg, loss_cfg, lse)
    return loss, {**fixed, **metrics}
