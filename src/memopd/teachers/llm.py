"""The LLM teacher (paper scale): a served model (gpt-oss-120b through vLLM) plays the protocol through
the student's rollout loop, behind the backend interface `generate(prompts, seeds) -> list[Generation]`.

Prompt modes (config `teacher.llm.prompt`):
  ids   the teacher shares the student's tokenizer (e.g. a Qwen2.5 teacher of a Qwen2.5 student): the
        student's prompt ids go in as a token prompt, the sampled ids and their log-probs come out and
        are recorded as they are (offline engine: backends.VLLMBackend; server: /v1/completions with a
        token-id prompt and `return_tokens_as_token_ids`).
  chat  the teacher has its own tokenizer and chat format (gpt-oss-120b: o200k + harmony): the student's
        prompt is decoded and sent as chat messages (system = the protocol's, user = the questions + the
        rewritten memory and newest observation); the reply (final channel: vLLM's reasoning parser
        keeps the analysis channel out of `content`) is cut after its first complete action and
        tokenised ONCE by the student's tokenizer. Those ids are what the record holds; log-probs are
        None, since the teacher's are over its own tokens. Server only.

Server: `vllm serve` started by the step as a child process bound to 127.0.0.1 on a free port (or
`url` of a server someone else runs), stopped when the step ends. Per-call seeds go with each request.
It runs under the step's own interpreter (`python -m vllm.entrypoints.cli.main serve`, what the `vllm`
script runs), not a `vllm` found on PATH: Snakemake started as .venv/bin/snakemake without activating the
venv leaves the venv's bin/ off PATH, and a PATH lookup could find another installation's vLLM.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from memopd.agent.protocol import STOP_STRINGS, SYSTEM_PROMPT, Generation, budget_text, encode
from memopd.config import LLM_ENGINES, TeacherServerConfig as Server
from memopd.generation.backends import Sampling, VLLMBackend
from memopd.teachers.scripted import split_prompt

HOST = "127.0.0.1"  # the server is never exposed beyond this machine


@dataclass
class LLMConfig:
    """Config `teacher.llm`."""

    model: str = "openai/gpt-oss-120b"
    engine: str = LLM_ENGINES[0]  # server | offline
    prompt: str = "chat"  # chat | ids
    url: str | None = None  # an OpenAI-compatible server already running (skips starting one)
    reasoning_effort: str | None = "low"  # gpt-oss: low | medium | high; None: the model's default
    sampling: dict = field(default_factory=lambda: {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                                    "max_new_tokens": 1024})
    server: dict = field(default_factory=dict)  # memopd.config.TeacherServerConfig's keys, as written

    def __post_init__(self):
        Server.from_dict(self.server)  # an unknown key is refused, naming teacher.llm.server
        if self.engine not in LLM_ENGINES or self.prompt not in ("chat", "ids"):
            raise ValueError(f"teacher.llm: engine must be server|offline, prompt chat|ids ({self.engine}, {self.prompt})")
        if self.engine == "offline" and self.prompt == "chat":
            raise ValueError("teacher.llm: the chat prompt needs the server (its reasoning parser and chat "
                             "template); use engine: server, or prompt: ids for a same-tokenizer teacher")
        self.sampling = Sampling(**self.sampling)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class VLLMServer:
    """`vllm serve MODEL` on 127.0.0.1 as a child process (own process group), ready when /health
    answers; a context manager that stops it (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, model: str, log_path: str | Path, seed: int = 0, port: int = Server.port,
                 dtype: str = Server.dtype, tensor_parallel_size: int = Server.tensor_parallel_size,
                 gpu_memory_utilization: float = Server.gpu_memory_utilization,
                 max_model_len: int | None = Server.max_model_len, startup_timeout_s: float = Server.startup_timeout_s,
                 extra_args: list[str] | None = None):
        self.model, self.log_path, self.timeout = model, Path(log_path), startup_timeout_s
        self.port = port or free_port()
        # the job's own interpreter, not PATH (see the module docstring); the module the `vllm` script runs
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", HOST,
                    "--port", str(self.port), "--seed", str(seed), "--dtype", dtype,
                    "--tensor-parallel-size", str(tensor_parallel_size),
                    "--gpu-memory-utilization", str(gpu_memory_utilization)]
        if max_model_len:
            self.cmd += ["--max-model-len", str(max_model_len)]
        self.cmd += list(extra_args or [])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> "VLLMServer":
        if importlib.util.find_spec("vllm") is None:  # finds the package without importing it
            raise RuntimeError(f"vLLM is not installed for {sys.executable}: the LLM teacher needs the GPU stack "
                               "(pip install -e '.[gpu]', or envs/gpu.yaml)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; its log: {self.log_path}\n"
                                   + _tail(self.log_path))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(2)
        self.__exit__(None, None, None)
        raise TimeoutError(f"vllm serve not ready after {self.timeout:.0f}s; its log: {self.log_path}")

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group we started: vllm's engine workers too
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


def post_json(url: str, body: dict, timeout: float = 600, retries: int = 3) -> dict:
    """POST a JSON body, return the JSON answer; connection errors are retried, HTTP errors raise with
    the server's message."""
    data = json.dumps(body).encode()
    for attempt in range(retries):
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if attempt + 1 == retries:
                raise
            time.sleep(2 ** attempt)
    raise AssertionError("unreachable")


def cut_after_action(text: str) -> tuple[str, bool]:
    """The reply up to and including its first </search> or </answer> (what the parser reads), and
    whether such a tag was found."""
    ends = [(i, t) for t in STOP_STRINGS if (i := text.find(t)) >= 0]
    if not ends:
        return text, False
    i, t = min(ends)
    return text[: i + len(t)], True


class LLMTeacher:
    """A served LLM behind the backend interface (see the module docstring)."""

    name = "llm"

    def __init__(self, tokenizer, cfg: LLMConfig, url: str | None = None, max_concurrency: int = Server.max_concurrency,
                 request_timeout_s: float = Server.request_timeout_s, llm=None):
        self.tok, self.cfg, self.url = tokenizer, cfg, (url or cfg.url or "").rstrip("/")
        self.workers, self.timeout = max_concurrency, request_timeout_s
        self.offline = None
        if cfg.engine == "offline":
            self.offline = VLLMBackend(cfg.model, tokenizer, cfg.sampling, llm=llm, **_offline_kwargs(cfg.server))
        elif not self.url:
            raise ValueError("LLMTeacher: engine 'server' needs a url (VLLMServer.url or teacher.llm.url)")
        # the student's chat template between the user message and the assistant's text
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "\x00U"}]
        rendered = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        self.header = rendered[rendered.index("\x00U") + 2:]

    def _sampling_body(self, seed: int) -> dict:
        s = self.cfg.sampling
        return {"model": self.cfg.model, "max_tokens": s.max_new_tokens, "temperature": s.temperature,
                "top_p": s.top_p, "top_k": s.top_k if s.top_k > 0 else -1, "seed": int(seed) % 2**31}

    def messages(self, prompt_text: str) -> list[dict]:
        """Chat messages of one decoded student prompt."""
        block, max_turns, ctx = split_prompt(prompt_text)
        ctx = ctx[len(self.header):] if ctx.startswith(self.header) else ctx
        user = f"{block}\n{budget_text(max_turns)}"
        if ctx.strip():
            user += ("\n\nYour memory and the newest search results (earlier turns are gone):\n" + ctx.strip()
                     + "\n\nContinue: write <think> memory </think>, then one <search> or <answer>.")
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]

    def _chat(self, prompt: list[int], seed: int) -> Generation:
        body = {**self._sampling_body(seed), "messages": self.messages(self.tok.decode(prompt, skip_special_tokens=False))}
        if self.cfg.reasoning_effort:
            body["reasoning_effort"] = self.cfg.reasoning_effort
        choice = post_json(f"{self.url}/v1/chat/completions", body, self.timeout)["choices"][0]
        text, closed = cut_after_action(choice["message"].get("content") or "")
        ids = encode(self.tok, text) or [self.tok.eos_token_id]  # an empty reply still is one (invalid) action
        reason = "stop" if closed else ("length" if choice.get("finish_reason") == "length" else "eos")
        return Generation(ids, None, reason)

    def _completion(self, prompt: list[int], seed: int) -> Generation:
        body = {**self._sampling_body(seed), "prompt": list(prompt), "stop": list(STOP_STRINGS),
                "stop_token_ids": [self.tok.eos_token_id], "include_stop_str_in_output": True,
                "skip_special_tokens": False, "logprobs": 0, "return_tokens_as_token_ids": True,
                "return_token_ids": True}
        choice = post_json(f"{self.url}/v1/completions", body, self.timeout)["choices"][0]
        return completion_generation(choice, self.tok.eos_token_id)

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Generation]:
        if len(prompts) != len(seeds):
            raise ValueError("one seed per prompt")
        if self.offline is not None:
            return self.offline.generate(prompts, seeds)
        call = self._chat if self.cfg.prompt == "chat" else self._completion
        with ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(prompts)))) as pool:
            return list(pool.map(call, prompts, seeds))  # vLLM batches concurrent requests itself


def completion_generation(choice: dict, eos_id: int) -> Generation:
    """A /v1/completions choice (token-id prompt, `return_tokens_as_token_ids`) -> exact ids, log-probs and
    stop reason. Ids come from `token_ids` (vLLM >= 0.10.2) or else from the "token_id:N" log-prob tokens."""
    lp = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:
        ids = [int(t.split(":", 1)[1]) for t in lp.get("tokens") or []]
    logprobs = lp.get("token_logprobs")
    if logprobs is not None and len(logprobs) != len(ids):
        raise RuntimeError(f"server returned {len(logprobs)} log-probs for {len(ids)} tokens")
    if choice.get("finish_reason") == "length":
        reason = "length"
    elif choice.get("stop_reason") is None or (ids and ids[-1] == eos_id):
        reason = "eos"
    else:
        reason = "stop"
    return Generation(list(ids), None if logprobs is None else [float(x) for x in logprobs], reason)


def _offline_kwargs(server: dict) -> dict:
    keys = {"dtype": "dtype", "gpu_memory_utilization": "gpu_memory_utilization", "max_model_len": "max_model_len"}
    return {v: server[k] for k, v in keys.items() if server.get(k) is not None}


def server_kwargs(server: dict) -> dict:
    """VLLMServer keyword arguments from config `teacher.llm.server` (max_concurrency and
    request_timeout_s belong to the client)."""
    keys = ("port", "dtype", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "startup_timeout_s",
            "extra_args")
    return {k: server[k] for k in keys if server.get(k) is not None}

