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
tokens: a decode step 648 -> 497 ms; `memopd bench decode`). The prefill (`prefill`, PREFILLS) is most of an
evaluation call on CPU: "padded" runs the batch as one left-padded forward; "sorted" runs groups of similar length
(prefill_groups: little padding computed); "shared" (the default) also runs the batch's common prefix (the system
prompt) once and lets every group attend to its keys. The decode then runs on one cache holding each row as
[prefix | masked gap | own tokens]: the same tokens as "padded", log-probs within float rounding (grouped forwards
sum in another order; `memopd bench eval` and tests/test_backends.py measure both). VLLMBackend: GPU, prompts
passed as token ids.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from memopd.agent.protocol import Generation
from memopd.attention import _CACHE_KW
from memopd.config import EngineConfig, RolloutConfig


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


PREFILLS = ("padded", "sorted", "shared")  # HFBackend's prefill: see prefill_groups and shared_prefix_len
GROUP_SLACK = 0.1  # a prefill group computes at most 10% more positions than its rows' tokens
MIN_SHARED = 32  # a common prefix shorter than this is prefilled with every row


def prefill_groups(lengths: list[int], slack: float = GROUP_SLACK) -> list[list[int]]:
    """Row indices in groups of similar length, shortest first: a group grows while its rows padded to its longest
    stay within (1 + slack) x their own tokens (a left-padded batch computes every padded position)."""
    groups: list[list[int]] = []
    real = 0
    for b in sorted(range(len(lengths)), key=lambda b: lengths[b]):
        if groups and lengths[b] * (len(groups[-1]) + 1) <= (1 + slack) * (real + lengths[b]):
            groups[-1].append(b)
            real += lengths[b]
        else:
            groups.append([b])
            real = lengths[b]
    return groups


def shared_prefix_len(prompts: list[list[int]], least: int = MIN_SHARED) -> int:
    """Length of the prompts' common prefix, leaving every row at least its last token (whose logits start
    decoding); 0 for a single prompt or a prefix shorter than `least`."""
    if len(prompts) < 2:
        return 0
    n = min(len(q) for q in prompts) - 1
    first = prompts[0]
    for q in prompts[1:]:
        n = next((i for i in range(n) if q[i] != first[i]), n)
    return n if n >= least else 0


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

    def __init__(self, model, tokenizer, sampling: Sampling, stop_strings=("</search>", "</answer>"),
                 prefill: str = "shared"):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        if prefill not in PREFILLS:
            raise ValueError(f"prefill must be one of {PREFILLS}, not {prefill!r}")
        self.model, self.tokenizer, self.sampling, self.prefill = model.eval(), tokenizer, sampling, prefill
        # the grouped prefills assemble full-attention caches; a sliding-window layer keeps the one padded forward
        self._plain_cache = all(type(x) is DynamicLayer for x in DynamicCache(config=model.config).layers)
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
        gens = [torch.Generator(device=dev).manual_seed(int(s)) for s in seeds]
        outs: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        reasons: list[str | None] = [None] * B
        rows = list(range(B))  # original index of each row still in the cache
        if self.prefill == "padded" or not self._plain_cache:
            logits, cache, mask, next_pos = self._prefill_padded(prompts)
        else:
            logits, cache, mask, next_pos = self._prefill_sorted(prompts, shared=self.prefill == "shared")
        for step in range(self.sampling.max_new_tokens):
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
            cache, logits = getattr(res, _CACHE_KW), res.logits[:, -1].float()
            next_pos = next_pos + 1
        return [Generation(outs[b], lps[b], reasons[b] or "length") for b in range(B)]

    def _prefill_padded(self, prompts: list[list[int]]):
        """(next-token logits (B, V), decode cache, attention mask, next position ids) of one left-padded forward."""
        ids, mask, pos = (t.to(self.device) for t in left_padded(prompts, self.pad))
        cache = self.make_cache(self.model.config, reserve=self.sampling.max_new_tokens)
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{_CACHE_KW: cache})
        return res.logits[:, -1].float(), getattr(res, _CACHE_KW), mask, pos[:, -1:] + 1

    def _prefill_sorted(self, prompts: list[list[int]], shared: bool):
        """`_prefill_padded`'s result, prefilled in groups of similar length (little padding computed) and, with
        `shared`, the batch's common prefix run once. The decode cache holds row b as [prefix | zeros | tail_b]
        with tails right-aligned; the mask hides the gap, so each row attends to exactly its own tokens."""
        dev, B = self.device, len(prompts)
        p = shared_prefix_len(prompts) if shared else 0
        head = self._prefix_kv(prompts[0][:p]) if p else None
        tails = [q[p:] for q in prompts]
        tail_mask = left_padded(tails, self.pad)[1]
        width = tail_mask.shape[1]
        logits, kv = None, []
        for group in prefill_groups([len(t) for t in tails]):
            out, layers = self._prefill_group([tails[b] for b in group], head)
            if logits is None:  # buffers in the model's dtype and head shapes, zeros where the mask hides
                logits = out.new_empty(B, out.shape[-1])
                kv = [tuple(x.new_zeros(B, x.shape[1], p + width, x.shape[-1]) for x in kv_) for kv_ in layers]
            idx, n = torch.tensor(group, device=dev), layers[0][0].shape[-2] - p
            logits[idx] = out
            for (K, V), (k, v) in zip(kv, layers):
                K[idx, :, p + width - n :], V[idx, :, p + width - n :] = k[:, :, p:], v[:, :, p:]
        cache = self.make_cache(self.model.config, reserve=self.sampling.max_new_tokens)
        for i in range(len(kv)):
            (K, V), kv[i] = kv[i], None  # a layer's buffers go once the cache holds them: one layer extra at a time
            if head:
                K[:, :, :p], V[:, :, :p] = head[i]
            cache.update(K, V, i)
        mask = torch.cat([torch.ones(B, p, dtype=torch.long), tail_mask], -1).to(dev)
        return logits, cache, mask, torch.tensor([[len(q)] for q in prompts], device=dev)

    def _prefix_kv(self, prefix: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (keys, values) of `prefix` run alone, (1, heads, len, dim) each."""
        from transformers import DynamicCache

        ids = torch.tensor([prefix], device=self.device)
        res = self.model(input_ids=ids, position_ids=torch.arange(len(prefix), device=self.device)[None],
                         use_cache=True, logits_to_keep=1, **{_CACHE_KW: DynamicCache(config=self.model.config)})
        return [(layer.keys, layer.values) for layer in getattr(res, _CACHE_KW).layers]

    def _prefill_group(self, tails: list[list[int]], head):
        """(next-token logits, every layer's (keys, values)) of one group's tails, left-padded, after `head`."""
        from transformers import DynamicCache

        ids, mask, pos = (t.to(self.device) for t in left_padded(tails, self.pad))
        cache, G = DynamicCache(config=self.model.config), len(tails)
        if head:
            p = head[0][0].shape[-2]
            for i, (k, v) in enumerate(head):
                cache.update(k.expand(G, -1, -1, -1), v.expand(G, -1, -1, -1), i)
            mask, pos = torch.cat([mask.new_ones(G, p), mask], -1), pos + p
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{_CACHE_KW: cache})
        return res.logits[:, -1].float(), [(layer.keys, layer.values) for layer in getattr(res, _CACHE_KW).layers]


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
                 dtype: str = "bfloat16", seed: int = 0,
                 gpu_memory_utilization: float = EngineConfig.gpu_memory_utilization, max_model_len: int | None = None,
                 llm=None):
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


def make_sampling(ro: RolloutConfig, **overrides) -> Sampling:
    """Sampling parameters of the `rollout` config section, with per-step overrides (e.g. eval's greedy)."""
    return Sampling(**ro.sampling(**overrides))


def make_backend(ro: RolloutConfig, model_dir: str | Path, seed: int = 0, **sampling_overrides):
    """The generation engine named by the `rollout` config section (`hf` or `vllm`)."""
    from memopd.models import default_device, load_model, load_tokenizer

    sampling = make_sampling(ro, **sampling_overrides)
    tok = load_tokenizer(model_dir)
    if ro.vllm_engine:
        return VLLMBackend(str(model_dir), tok, sampling, dtype=ro.dtype, seed=seed,
                           gpu_memory_utilization=ro.vllm.gpu_memory_utilization,
                           max_model_len=ro.vllm.max_model_len), tok, None
    model = load_model(model_dir, dtype=ro.dtype, device=ro.device or default_device())
    return HFBackend(model, tok, sampling), tok, model
