"""Generation backends behind one interface: token ids in, exact token ids and log-probs out.

    backend.generate(prompts: list[list[int]], seeds: list[int]) -> list[Generation]

Each prompt is sampled with its own seed (a per-row generator), so an episode's samples do not depend
on which other episodes share its batch. Generation stops after a stop string (`</search>`,
`</answer>`), at EOS, or at `max_new_tokens` ("length"). The behaviour log-probs are the model's own
log-probabilities of the sampled tokens (log-softmax of the raw logits: before temperature / top-p /
top-k), i.e. log pi(a | state) of the policy that PPO's ratio and the recomputation compare against.

HFBackend: transformers on CPU or GPU, a hand-written sampling loop over a KV cache (left-padded prefill,
then one token per step; finished rows leave the cache). The cache is `growing_cache`'s: transformers'
DynamicLayer appends by `torch.cat`, copying the whole cache of every layer at every step; its layers write
into buffers with room for the new tokens, so a step copies only those (one thread, SmolLM2, 32 rows of 450
tokens: a decode step 648 -> 497 ms; `memopd bench decode`). VLLMBackend: GPU, prompts passed as token ids.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from memopd.attention import _CACHE_KW


@dataclass
class Sampling:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    max_new_tokens: int = 64

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError(f"bad sampling parameters {self}")


@functools.cache
def _growing_layer():
    """transformers' DynamicLayer with a buffer (class built on first use: transformers is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        reserve = 0  # free positions a new buffer keeps after the tokens it is made for (set per cache)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self._k = self._v = None
            n = self.get_seq_length()
            m = n + key_states.shape[-2]
            # a new buffer when there is none, when it is full (room for m + reserve, at least doubling), or when
            # an operation of DynamicLayer replaced the keys (batch_select_indices, crop, reorder_cache, ...)
            full = self._k is None or m > self._k.shape[-2]
            if full or (n and self.keys.data_ptr() != self._k.data_ptr()):
                cap = m + self.reserve if self._k is None else max(m + self.reserve, self._k.shape[-2] * (1 + full))
                k = key_states.new_empty(*key_states.shape[:-2], cap, key_states.shape[-1])
                v = value_states.new_empty(*value_states.shape[:-2], cap, value_states.shape[-1])
                if n:
                    k[..., :n, :], v[..., :n, :] = self.keys, self.values
                self._k, self._v = k, v
            self._k[..., n:m, :], self._v[..., n:m, :] = key_states, value_states
            self.keys, self.values = self._k[..., :m, :], self._v[..., :m, :]
            return self.keys, self.values

    return DynamicLayer, GrowingLayer


def growing_cache(config, reserve: int):
    """A transformers DynamicCache whose full-attention layers keep their keys / values in buffers with
    `reserve` free positions after the prefill (doubling when full): a decode step writes its token into the
    buffer instead of concatenating the whole cache. A layer returns the same values in the same order as
    DynamicLayer (a view of the buffer's filled part), so attention and its result are unchanged."""
    from transformers import DynamicCache

    plain, growing = _growing_layer()
    cache = DynamicCache(config=config)
    layers = []
    for layer in cache.layers:  # only plain full-attention layers: a sliding-window layer keeps its own class
        if type(layer) is plain:
            layer = growing()
            layer.reserve = reserve
        layers.append(layer)
    cache.layers = layers
    return cache


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, position ids), each (B, L): the prompts left-padded to the longest, so every row's
    next token sits in the last column; positions count each row's own tokens from 0."""
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[b, L - len(p) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@dataclass
class Generation:
    output_ids: list[int]
    logprobs: list[float] | None
    stop_reason: str  # "stop" (stop string), "eos", "length"


def stop_token_ids(tokenizer, stop_strings) -> tuple[set[int], list[str]]:
    """Split stop strings into single-token stops (checked on ids) and the rest (checked on text)."""
    ids, strings = set(), []
    for s in stop_strings:
        enc = tokenizer(s, add_special_tokens=False)["input_ids"]
        if len(enc) == 1:
            ids.add(enc[0])
        else:
            strings.append(s)
    return ids, strings


def sample_next(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator]) -> torch.Tensor:
    """(B, V) raw logits -> (B,) sampled ids, row b drawn with generators[b]."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    x = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = x.topk(min(sampling.top_k, x.shape[-1]), dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sx, order = x.sort(dim=-1, descending=True)
        cum = sx.softmax(-1).cumsum(-1)
        drop = cum - sx.softmax(-1) >= sampling.top_p  # keep the smallest prefix reaching top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    probs = x.softmax(-1)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


class HFBackend:
    """Batched sampling with a transformers causal LM and its KV cache."""

    name = "hf"
    make_cache = staticmethod(growing_cache)  # (model config, reserve) -> KV cache; memopd bench decode swaps it

    def __init__(self, model, tokenizer, sampling: Sampling, stop_strings=("</search>", "</answer>")):
        self.model, self.tokenizer, self.sampling = model.eval(), tokenizer, sampling
        self.eos = {tokenizer.eos_token_id} | set(_as_list(getattr(model.generation_config, "eos_token_id", None)))
        self.stop_ids, self.stop_strings = stop_token_ids(tokenizer, stop_strings)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.device = next(model.parameters()).device

    def _stopped(self, out: list[int]) -> str | None:
        last = out[-1]
        if last in self.stop_ids:
            return "stop"
        if last in self.eos:
            return "eos"
        if self.stop_strings:  # multi-token stop strings: look at the decoded tail only
            tail = self.tokenizer.decode(out[-16:], skip_special_tokens=False)
            if any(s in tail for s in self.stop_strings):
                return "stop"
        return None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Generation]:
        if len(prompts) != len(seeds):
            raise ValueError("one seed per prompt")
        if not prompts:
            return []
        dev, B = self.device, len(prompts)
        ids, mask, pos = (t.to(dev) for t in left_padded(prompts, self.pad))
        gens = [torch.Generator(device=dev).manual_seed(int(s)) for s in seeds]
        outs: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        reasons: list[str | None] = [None] * B
        rows = list(range(B))  # original index of each row still in the cache
        cache = self.make_cache(self.model.config, reserve=self.sampling.max_new_tokens)
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{_CACHE_KW: cache})
        cache = getattr(res, _CACHE_KW)
        next_pos = pos[:, -1:] + 1
        for step in range(self.sampling.max_new_tokens):
            logits = res.logits[:, -1].float()
            tok = sample_next(logits, self.sampling, [gens[r] for r in rows])
            lp = torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
            keep = []
            for i, r in enumerate(rows):
                outs[r].append(int(tok[i]))
                lps[r].append(float(lp[i]))
                reasons[r] = self._stopped(outs[r])
                if reasons[r] is None:
                    keep.append(i)
            if not keep or step + 1 == self.sampling.max_new_tokens:
                break
            if len(keep) < len(rows):  # finished rows leave the batch and the cache
                sel = torch.tensor(keep, device=dev)
                cache.batch_select_indices(sel)
                tok, mask, next_pos = tok[sel], mask[sel], next_pos[sel]
                rows = [rows[i] for i in keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            res = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, use_cache=True,
                             **{_CACHE_KW: cache})
            cache = getattr(res, _CACHE_KW)
            next_pos = next_pos + 1
        return [Generation(outs[b], lps[b], reasons[b] or "length") for b in range(B)]


def _as_list(x):
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


class VLLMBackend:
    """vLLM on GPU: prompts go in as token ids, token ids and the sampled tokens' log-probs come out.

    Stop strings are kept in the output (`include_stop_str_in_output`) and special tokens are not
    skipped, so the recorded ids are exactly what was sampled; the text vLLM detokenises is not used."""

    name = "vllm"

    def __init__(self, model_path: str, tokenizer, sampling: Sampling, stop_strings=("</search>", "</answer>"),
                 dtype: str = "bfloat16", seed: int = 0, gpu_memory_utilization: float = 0.85,
                 max_model_len: int | None = None, llm=None):
        from vllm import LLM  # GPU environment only (envs/gpu.yaml)

        self.tokenizer, self.sampling, self.stop_strings = tokenizer, sampling, list(stop_strings)
        self.eos_ids = sorted({tokenizer.eos_token_id})
        self.llm = llm or LLM(model=str(model_path), dtype=dtype, seed=seed, max_model_len=max_model_len,
                              gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True)

    def params(self, seed: int):
        from vllm import SamplingParams

        s = self.sampling
        return SamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=s.max_new_tokens, seed=int(seed), logprobs=0, stop=self.stop_strings,
            stop_token_ids=self.eos_ids, include_stop_str_in_output=True, skip_special_tokens=False,
        )

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 sampling_params=[self.params(s) for s in seeds], use_tqdm=False)
        gens = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = None if c.logprobs is None else [float(c.logprobs[k][t].logprob) for k, t in enumerate(ids)]
            if c.finish_reason == "length":
                reason = "length"
            elif c.stop_reason is None or (ids and ids[-1] in self.eos_ids):
                reason = "eos"
            else:
                reason = "stop"
            gens.append(Generation(ids, lps, reason))
        return gens
