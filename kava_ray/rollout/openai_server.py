"""A teacher behind a URL (`teachers[].engine: openai`): vLLM's OpenAI-compatible server, read for
prompt log-probs as TRL, verl and ms-swift read it.

`prompt_topk` asks `/v1/completions` for each row's prompt log-probs (`prompt_logprobs: k`, vLLM's
extension) and the one token after it (`logprobs: k`, ids as `token_id:N`), at temperature 1, and
returns `VLLMEngine.prompt_topk`'s layout, so `core.prompt_logprobs.topk_batch` builds the same
logits-only KVBatch as for a vLLM teacher in the actor. `sample` writes completions (on-policy's
`source: teacher`). The API key is read from the environment variable the config names and sent as
a bearer token; it is never logged.

Every failure is one line that names the teacher and the URL (`ServerError`): the server down or
slow (after `retries` tries with exponential backoff), a 4xx (at once: a model it does not serve, a
top-k past its `--max-logprobs`), a 5xx (after the retries), fewer log-probs than asked.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from typing import Optional

import requests
import torch

from kava_ray.common.errors import KavaError

PROBE = "Distillation: 12 teachers, 3.5 GB, naïve café — ok?"  # the tokenizer check's text (numbers, accents)


class ServerError(KavaError):
    """A teacher server's failure, in one line."""


class OpenAIServer:
    """One teacher server: base `url`, the `model` name it serves, the API key's environment variable
    (`api_key_env`, or None), `timeout_s` a request, `retries` more tries with backoff (0.5 s, 1 s,
    2 s, ...), `concurrency` requests at once; `name` names the teacher in errors."""

    def __init__(self, url: str, model: str, name: str, api_key_env: Optional[str] = None, timeout_s: float = 60.0,
                 retries: int = 3, concurrency: int = 4):
        self.url, self.model, self.name = url.rstrip("/").removesuffix("/v1"), model, name
        self.timeout_s, self.retries, self.concurrency = float(timeout_s), int(retries), int(concurrency)
        key = None
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise ServerError(f"teachers[{name}].api_key_env: the environment variable {api_key_env} is not set "
                                  f"where this teacher runs (it holds the server's API key; on a cluster, set it on "
                                  f"the teacher's nodes)")
        self.session = requests.Session()
        if key:
            self.session.headers["Authorization"] = f"Bearer {key}"
        self.requests = self.retried = 0

    def _where(self) -> str:
        return f"teacher '{self.name}' at {self.url}"

    def _call(self, method: str, path: str, body: Optional[dict] = None) -> dict:
        """One request, retried on a connection error, a timeout, 429 or 5xx; one line when it fails."""
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.retried += 1
                time.sleep(0.5 * 2 ** (attempt - 1))
            self.requests += 1
            try:
                r = self.session.request(method, self.url + path, json=body, timeout=self.timeout_s)
            except requests.Timeout:
                last = f"no answer within teachers[{self.name}].timeout_s={self.timeout_s:g} s"
                continue
            except requests.ConnectionError as e:
                last = "no server answers" + (" (connection refused)" if "refused" in str(e).lower() else "")
                continue
            if r.status_code == 429 or r.status_code >= 500:
                last = f"HTTP {r.status_code}: {_message(r)}"
                continue
            if r.status_code >= 400:
                hint = " (check teachers[].api_key_env)" if r.status_code in (401, 403) else ""
                raise ServerError(f"{self._where()}: {path} answered HTTP {r.status_code}: {_message(r)}{hint}")
            try:
                return r.json()
            except ValueError:
                raise ServerError(f"{self._where()}: {path} answered HTTP {r.status_code} with no JSON") from None
        tries = f" ({self.retries + 1} tries)" if self.retries else ""
        raise ServerError(f"{self._where()}: {path}: {last}{tries}")

    def served_models(self) -> list[str]:
        """The model names the server serves (`/v1/models`)."""
        return [m["id"] for m in self._call("GET", "/v1/models").get("data", [])]

    def check(self, tokenizer) -> dict:
        """Before any batch: the server answers, serves `model`, and tokenizes as `tokenizer` (vLLM's
        `/tokenize` on a probe text); one line for each that does not hold. Returns the server's
        model card ({id, max_model_len, ...})."""
        cards = {m["id"]: m for m in self._call("GET", "/v1/models").get("data", [])}
        if self.model not in cards:
            raise ServerError(f"{self._where()} serves {', '.join(map(repr, cards)) or 'no model'}, not "
                              f"{self.model!r} (teachers[{self.name}].model names the served model)")
        theirs = self._call("POST", "/tokenize", {"model": self.model, "prompt": PROBE,
                                                  "add_special_tokens": False}).get("tokens")
        ours = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        if theirs != ours:
            raise ServerError(f"{self._where()}: its tokenizer differs from the one loaded here (teachers[{self.name}]"
                              f".tokenizer): {PROBE!r} is {len(theirs or [])} tokens there, {len(ours)} here")
        return cards[self.model]

    def _completions(self, prompts: list[list[int]], body: dict) -> list[dict]:
        """The choices of `/v1/completions` for each prompt, in order: the prompts split over
        `concurrency` requests at once."""
        if not prompts:
            return []
        n = max(1, -(-len(prompts) // self.concurrency))
        chunks = [prompts[i:i + n] for i in range(0, len(prompts), n)]
        with concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool:
            answers = list(pool.map(lambda c: self._call("POST", "/v1/completions",
                                                         {"model": self.model, "prompt": c, **body}), chunks))
        out = []
        for chunk, a in zip(chunks, answers):
            choices = sorted(a.get("choices", []), key=lambda c: c["index"])
            if len(choices) != len(chunk):
                raise ServerError(f"{self._where()}: {len(choices)} completions for {len(chunk)} prompts")
            out += choices
        return out

    def prompt_topk(self, seqs: list[list[int]], k: int, last: bool = False
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """`VLLMEngine.prompt_topk` through the server: per sequence of n tokens, (top-k ids [n, k]
        int64, their log-probs [n, k] fp32 descending, each next token's log-prob [n] fp32), position
        t predicting token t + 1 at temperature 1; the last position's top-k from the one token the
        request generates when `last`, else -inf."""
        body = {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": int(k),
                "logprobs": int(k) if last else None, "return_tokens_as_token_ids": True, "seed": 0}
        res = []
        for s, c in zip(seqs, self._completions([list(map(int, s)) for s in seqs], body)):
            n = len(s)
            ids = torch.zeros((n, k), dtype=torch.long)
            lp = torch.full((n, k), float("-inf"))
            nxt = torch.zeros(n)
            plp = c.get("prompt_logprobs") or []
            if len(plp) != n:
                raise ServerError(f"{self._where()}: prompt log-probs for {len(plp)} of {n} positions (is it vLLM's "
                                  f"OpenAI-compatible server?)")
            for t in range(n - 1):
                d = plp[t + 1]  # {id: {logprob, rank, ...}} conditioned on s[:t + 1]: the actual token and the top-k
                own = d.get(str(s[t + 1]))
                if own is None:
                    raise ServerError(f"{self._where()}: no log-prob for the prompt's own token at position {t + 1}")
                nxt[t] = float(own["logprob"])
                top = sorted((v["rank"], int(i), v["logprob"]) for i, v in d.items()
                             if v.get("rank") is not None and v["rank"] <= k)[:k]
                self._enough(len(top), k)
                for j, (_, i, v) in enumerate(top):
                    ids[t, j], lp[t, j] = i, float(v)
            if last and k:
                d = (c.get("logprobs") or {}).get("top_logprobs") or [{}]
                top = sorted(((-float(v), int(tok.removeprefix("token_id:"))) for tok, v in d[0].items()))[:k]
                self._enough(len(top), k)
                for j, (v, i) in enumerate(top):
                    ids[n - 1, j], lp[n - 1, j] = i, -v
            res.append((ids, lp, nxt))
        return res

    def _enough(self, got: int, k: int) -> None:
        if got < k:
            raise ServerError(f"{self._where()}: {got} log-probs at a position, {k} asked (loss.logit_top_k): "
                              f"start it with --max-logprobs {k} or more")

    def sample(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
               seed: int = 0, eos_id: Optional[int] = None) -> list[list[int]]:
        """Sampled completions (token ids) of `prompts`, through the server, seeded per prompt."""
        body = {"max_tokens": int(max_new_tokens), "temperature": float(temperature), "top_p": float(top_p),
                "seed": int(seed), "return_token_ids": True}
        return [list(c.get("token_ids") or []) for c in self._completions(prompts, body)]


def _message(r) -> str:
    """The server's error message in one line (OpenAI's {"error": {"message"}}, vLLM's {"message"})."""
    try:
        body = r.json()
    except ValueError:
        return (r.text or r.reason or "").strip().splitlines()[0][:200] if (r.text or r.reason) else ""
    err = body.get("error", body) if isinstance(body, dict) else body
    msg = err.get("message") if isinstance(err, dict) else err
    return " ".join(str(msg if msg is not None else json.dumps(body)).split())[:300]
