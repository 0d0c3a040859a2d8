"""task=serve: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous batcher.

    python launch.py task=serve model=hf checkpoint.load_hf=<HF dir> serve.port=8000
    python launch.py task=serve checkpoint.load=outputs/<run>/checkpoints parallel=tp2

/v1/chat/completions (the tokenizer's chat template; Qwen3's thinking switch as vLLM's
`chat_template_kwargs: {"enable_thinking": …}`), /v1/completions, /v1/models, /health; `stream: true` sends
server-sent events. Bad requests get OpenAI-shaped errors with status 400, a full queue 503. Under tensor
parallelism rank 0 serves HTTP and schedules; every step goes to the other ranks (speedllm.generation.batching).
"""

import asyncio
import contextlib
import json
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, List, Optional

import torch.distributed as dist
from omegaconf import DictConfig

from speedllm.data.tokenizer import stop_ids_of, tokenizer_for
from speedllm.errors import UserError
from speedllm.generation.batching import Batcher, QueueFull, Request, new_slot_cache, serve_steps
from speedllm.generation.engine import Detokenizer
from speedllm.generation.load import DTYPES, load_model
from speedllm.generation.sampling import Sampling
from speedllm.runtime import Runtime

MAX_STOPS = 4  # OpenAI's limit on stop strings


class ApiError(Exception):
    """An error answered as OpenAI's {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _number(body: dict, key: str, default, kind, ok, rule: str):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and int(value) != value):
        raise ApiError(400, f"{key}={value!r} must be a number ({rule})", key, "invalid_value")
    value = kind(value)
    if not ok(value):
        raise ApiError(400, f"{key}={value} is out of range: {rule}", key, "invalid_value")
    return value


class Server:
    """Turns OpenAI requests into batcher requests and their tokens back into OpenAI responses."""

    def __init__(self, batcher: Batcher, tokenizer, model_id: str, max_len: int, api_key: Optional[str],
                 enable_thinking: bool):
        self.batcher, self.tokenizer, self.model_id = batcher, tokenizer, model_id
        self.max_len, self.api_key, self.enable_thinking = max_len, api_key, enable_thinking
        self.stop_ids = stop_ids_of(tokenizer)
        self.created = int(time.time())

    # ---------------------------------------------------------------- parsing
    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise ApiError(400, f"The model `{model}` does not exist; this server serves `{self.model_id}`",
                           "model", "model_not_found")

    def sampling_of(self, body: dict, prompt_len: int, chat: bool) -> dict:
        """Sampling settings, limits and stops of a request, checked. max_tokens defaults as OpenAI's: the rest
        of the context for chat, 16 for a completion."""
        temperature = _number(body, "temperature", 1.0, float, lambda v: 0 <= v <= 2, "0 <= temperature <= 2")
        top_p = _number(body, "top_p", 1.0, float, lambda v: 0 < v <= 1, "0 < top_p <= 1")
        top_k = _number(body, "top_k", 0, int, lambda v: v >= -1, "top_k >= 0 (0 or -1: off)")
        n = _number(body, "n", 1, int, lambda v: 1 <= v <= self.batcher.max_queue, "1 <= n <= serve.max_queue")
        seed = _number(body, "seed", None, int, lambda v: True, "an integer")
        room = self.max_len - prompt_len
        if room < 1:
            raise ApiError(400, f"This model's maximum context length is {self.max_len} tokens. However, your "
                           f"prompt has {prompt_len} tokens, which leaves no room for a completion.",
                           "messages" if "messages" in body else "prompt", "context_length_exceeded")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _number(body, key, room if chat else min(16, room), int, lambda v: v >= 1, f"{key} >= 1")
        if prompt_len + max_tokens > self.max_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_len} tokens. However, you "
                           f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                           f"for the completion). Please reduce the length of the prompt or {key}.",
                           key, "context_length_exceeded")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings",
                           "stop", "invalid_value")
        return dict(sampling=Sampling(temperature, max(top_k, 0), top_p), max_tokens=max_tokens, n=n, seed=seed,
                    stop=stop)

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_prompt(self, body: dict) -> List[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages", "invalid_value")
        rendered = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: the text ones
                content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
            if not isinstance(content, str) or m.get("role") not in ("system", "user", "assistant", "tool"):
                raise ApiError(400, "every message needs a role (system, user, assistant, tool) and text content",
                               "messages", "invalid_value")
            rendered.append({"role": m["role"], "content": content})
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = bool(kwargs.get("enable_thinking", self.enable_thinking))
        text = self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=thinking)
        return self.encode(text)

    def completion_prompt(self, body: dict) -> List[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        elif isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            raise ApiError(400, "prompt must be a string (or one list of token ids)", "prompt", "invalid_value")
        if not ids:
            raise ApiError(400, "prompt is empty", "prompt", "invalid_value")
        if max(ids) >= self.batcher.model.cfg.vocab_size or min(ids) < 0:
            raise ApiError(400, "prompt holds token ids outside the vocabulary", "prompt", "invalid_value")
        return ids

    # ---------------------------------------------------------------- running
    def submit(self, prompt_ids: List[int], params: dict, events: asyncio.Queue) -> List[Request]:
        """The request's n completions, queued; their events arrive in `events` as (choice index, token | None)."""
        loop = asyncio.get_running_loop()
        requests = []
        for i in range(params["n"]):
            seed = None if params["seed"] is None else params["seed"] + i

            def on_event(token, i=i):
                loop.call_soon_threadsafe(events.put_nowait, (i, token))

            requests.append(Request(prompt_ids, params["max_tokens"], params["sampling"], seed, params["stop"],
                                    on_event))
        try:
            self.batcher.submit(requests)
        except QueueFull as e:
            raise ApiError(503, f"The server is busy: {e}; retry later", None, "queue_full") from None
        return requests

    def usage(self, prompt_ids, requests) -> dict:
        completion = sum(len(r.out_ids) for r in requests)
        return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                "total_tokens": len(prompt_ids) + completion}

    async def respond(self, body: dict, chat: bool):
        """The JSON response, or an async iterator of server-sent events when body["stream"]."""
        self.check_model(body)
        prompt_ids = self.chat_prompt(body) if chat else self.completion_prompt(body)
        params = self.sampling_of(body, len(prompt_ids), chat)
        events: asyncio.Queue = asyncio.Queue()
        requests = self.submit(prompt_ids, params, events)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model_id}
        texts = [Detokenizer(self.tokenizer, self.stop_ids, params["stop"]) for _ in requests]
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return self.stream(head, chat, prompt_ids, requests, texts, events, include_usage)
        try:
            left = len(requests)
            while left:
                i, token = await events.get()
                left -= token is None
        finally:
            for r in requests:
                r.cancelled = True  # a no-op for finished requests; frees the rows if this handler was cancelled
        if any(r.finish_reason == "cancelled" for r in requests):
            raise ApiError(503, "The server stopped before the completion was done", None, "shutting_down")
        choices = []
        for i, (r, text) in enumerate(zip(requests, texts)):
            content = text.extend(r.out_ids).finish()
            choices.append({"index": i, "finish_reason": r.finish_reason, "logprobs": None,
                            **({"message": {"role": "assistant", "content": content}} if chat else {"text": content})})
        return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": self.usage(prompt_ids, requests)}

    async def stream(self, head, chat, prompt_ids, requests, texts, events, include_usage) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i, text, finish_reason=None, first=False):
            if chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
                choice = {"index": i, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            else:
                choice = {"index": i, "text": text, "finish_reason": finish_reason, "logprobs": None}
            return "data: " + json.dumps({**head, "object": kind, "choices": [choice]}) + "\n\n"

        try:
            if chat:
                for i in range(len(requests)):
                    yield chunk(i, "", first=True)
            left = len(requests)
            while left:
                i, token = await events.get()
                if token is None:
                    left -= 1
                    yield chunk(i, texts[i].finish(), requests[i].finish_reason)
                    continue
                piece = texts[i].add(token)
                if piece:
                    yield chunk(i, piece)
            if include_usage:
                yield "data: " + json.dumps({**head, "object": kind, "choices": [],
                                             "usage": self.usage(prompt_ids, requests)}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for r in requests:  # the client went away mid-stream: its rows are freed before the next step
                r.cancelled = True


def build_app(server: Server):
    """The FastAPI application of `server`."""
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="SpeedLLM", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    def check_key(request: HttpRequest) -> None:
        if server.api_key is not None and request.headers.get("authorization") != f"Bearer {server.api_key}":
            raise ApiError(401, "Incorrect API key provided", None, "invalid_api_key")

    async def read_json(request: HttpRequest) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
        return body

    async def complete(request: HttpRequest, chat: bool):
        check_key(request)
        result = await server.respond(await read_json(request), chat)
        if isinstance(result, dict):
            return result
        return StreamingResponse(result, media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": server.batcher.num_running, "waiting": server.batcher.num_waiting}

    @app.get("/v1/models")
    async def models(request: HttpRequest):
        check_key(request)
        return {"object": "list", "data": [{"id": server.model_id, "object": "model", "created": server.created,
                                            "owned_by": "speedllm", "max_model_len": server.max_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await complete(request, chat=False)

    return app


def model_id_of(cfg: DictConfig) -> str:
    """serve.model_name, else the HF directory's name, else the model's name."""
    if cfg.serve.model_name:
        return cfg.serve.model_name
    if cfg.checkpoint.load_hf is not None:
        return Path(cfg.checkpoint.load_hf).resolve().name
    return cfg.model.name


def run(cfg: DictConfig, rt: Runtime) -> None:
    """task=serve: load the model, then serve on rank 0 (other ranks follow its steps) until SIGTERM/SIGINT."""
    s = cfg.serve
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise UserError("task=serve needs FastAPI and uvicorn: pip install -e '.[serve]'") from None
    model = load_model(cfg, rt)
    max_len = min(s.max_len, cfg.model.max_position_embeddings)
    dtype, tp = DTYPES[cfg.hardware.dtype], cfg.parallel.tp
    if not rt.is_main:
        # SIGTERM/SIGINT reach every rank; these follow rank 0, which stops them once its server is down.
        with handle_signals(lambda: None):
            serve_steps(model, new_slot_cache(model.cfg, s.max_batch, max_len, dtype, rt.device, tp))
        return
    tokenizer = tokenizer_for(cfg)
    batcher = Batcher(model, tokenizer, stop_ids_of(tokenizer), s.max_batch, max_len, s.max_queue, dtype, tp,
                      broadcast=dist.is_initialized())
    thread = threading.Thread(target=batcher.run, name="batcher", daemon=True)
    thread.start()
    server = Server(batcher, tokenizer, model_id_of(cfg), max_len, s.api_key, cfg.generate.enable_thinking)
    config = uvicorn.Config(build_app(server), host=s.host, port=s.port, log_level="warning",
                            timeout_graceful_shutdown=2)
    http = uvicorn.Server(config)
    print(f"serving {server.model_id} on http://{s.host}:{s.port}/v1 (max_batch {s.max_batch}, "
          f"{max_len} tokens per request)", flush=True)
    stop = threading.Event()
    http_thread = threading.Thread(target=http.run, name="http")
    with handle_signals(stop.set):
        http_thread.start()
        # until SIGTERM/SIGINT, or either thread ends (a failed batcher step: its clients got an error)
        while http_thread.is_alive() and thread.is_alive() and not stop.wait(0.2):
            pass
        batcher_failed = not thread.is_alive()
        http.should_exit = True
        http_thread.join()
        batcher.stop()
        thread.join()
    if not http.started:
        raise UserError(f"serve.host={s.host} serve.port={s.port}: could not listen there (see above); pick a "
                        "free port")
    if batcher_failed:
        raise RuntimeError("the batcher stopped after an error (traceback above)")
    print("server stopped", flush=True)


@contextlib.contextmanager
def handle_signals(handler):
    """Call handler() on SIGTERM/SIGINT (main thread only). uvicorn runs in a thread, where it sets no handlers
    of its own: in the main thread it re-raises the signal after shutting down, which would end the process
    before the batcher and the other ranks stop."""
    previous = {sig: signal.signal(sig, lambda *_: handler()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
