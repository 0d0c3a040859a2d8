"""task=serve: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous batcher.

    python launch.py task=serve model=hf checkpoint.load_hf=<HF dir> serve.port=8000
    python launch.py task=serve checkpoint.load=outputs/<run>/checkpoints parallel=tp2

/v1/chat/completions (the tokenizer's chat template; Qwen3's thinking switch as vLLM's
`chat_template_kwargs: {"enable_thinking": …}`), /v1/completions, /v1/models, /health; `stream: true` sends
server-sent events. Every request is checked at the edge (speedllm.generation.openai_schema, then what depends on
the model): whatever a client sends, its mistake gets a 4xx with OpenAI's error JSON, never a 5xx (limits in
docs/serve-hardening.md). Under tensor parallelism rank 0 serves HTTP and schedules; every step goes to the other
ranks (speedllm.generation.batching).
"""

import asyncio
import contextlib
import hmac
import json
import signal
import threading
import time
import uuid
from dataclasses import replace
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
from speedllm.models.kv_cache import cache_bytes, cache_shape
from speedllm.models.rope import max_positions
from speedllm.planner.spec import INFERENCE, at_least
from speedllm.runtime import Runtime


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


class Server:
    """Turns OpenAI requests into batcher requests and their tokens back into OpenAI responses."""

    def __init__(self, batcher: Batcher, tokenizer, model_id: str, max_len: int, api_key: Optional[str],
                 enable_thinking: bool):
        self.batcher, self.tokenizer, self.model_id = batcher, tokenizer, model_id
        self.max_len, self.api_key, self.enable_thinking = max_len, api_key, enable_thinking
        self.stop_ids = stop_ids_of(tokenizer)
        self.created = int(time.time())

    # ---------------------------------------------------------------- parsing
    def check_model(self, req) -> None:
        if req.model is not None and req.model != self.model_id:
            raise ApiError(400, f"The model `{clip(req.model)}` does not exist; this server serves "
                           f"`{self.model_id}`", "model", "model_not_found")

    def sampling_of(self, req, prompt_len: int, chat: bool) -> dict:
        """Sampling settings, limits and stops of a request (its schema checked each alone). max_tokens defaults
        as OpenAI's: the rest of the context for chat, 16 for a completion."""
        if req.n > self.batcher.max_queue:
            raise ApiError(400, f"n={req.n} is more than this server queues (serve.max_queue="
                           f"{self.batcher.max_queue})", "n", "invalid_value")
        room = self.max_len - prompt_len
        if room < 1:
            raise ApiError(400, f"This model's maximum context length is {self.max_len} tokens. However, your "
                           f"prompt has {prompt_len} tokens, which leaves no room for a completion.",
                           "messages" if chat else "prompt", "context_length_exceeded")
        key, max_tokens = "max_tokens", req.max_tokens
        if chat and req.max_completion_tokens is not None:
            key, max_tokens = "max_completion_tokens", req.max_completion_tokens
        if max_tokens is None:
            max_tokens = room if chat else min(16, room)
        if prompt_len + max_tokens > self.max_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_len} tokens. However, you "
                           f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                           f"for the completion). Please reduce the length of the prompt or {key}.",
                           key, "context_length_exceeded")
        return dict(sampling=Sampling(req.temperature, max(req.top_k, 0), req.top_p), max_tokens=max_tokens,
                    n=req.n, seed=req.seed, stop=req.stops)

    def encode(self, text: str) -> List[int]:
        # verbose=False: a prompt longer than the tokenizer's model_max_length is the client's, answered with a
        # 400 (context_length_exceeded), not a warning in the server's log
        return self.tokenizer.encode(text, add_special_tokens=False, verbose=False)

    def chat_prompt(self, req) -> List[int]:
        from jinja2 import TemplateError

        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        kwargs = req.chat_template_kwargs
        thinking = kwargs.enable_thinking if kwargs is not None and kwargs.enable_thinking is not None \
            else self.enable_thinking
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=thinking)
        except TemplateError as e:  # the model's own template refuses the conversation (e.g. no user turn)
            raise ApiError(400, f"the chat template refused these messages: {clip(str(e))}", "messages",
                           "invalid_value") from None
        return self.encode(text)

    def completion_prompt(self, req) -> List[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str):  # a list of one string
            prompt = prompt[0]
        ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise ApiError(400, "prompt is empty", "prompt", "invalid_value")
        vocab_size = self.batcher.model.cfg.vocab_size
        if max(ids) >= vocab_size or min(ids) < 0:
            raise ApiError(400, f"prompt holds token ids outside the vocabulary (0..{vocab_size - 1})", "prompt",
                           "invalid_value")
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

    async def respond(self, req, chat: bool):
        """The JSON response to a parsed request (speedllm.generation.openai_schema), or an async iterator of
        server-sent events when req.stream."""
        self.check_model(req)
        # off the event loop: a long prompt takes seconds to tokenize (the tokenizer releases the GIL)
        prompt_ids = await asyncio.to_thread(self.chat_prompt if chat else self.completion_prompt, req)
        params = self.sampling_of(req, len(prompt_ids), chat)
        events: asyncio.Queue = asyncio.Queue()
        requests = self.submit(prompt_ids, params, events)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model_id}
        texts = [Detokenizer(self.tokenizer, self.stop_ids, params["stop"]) for _ in requests]
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
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


def clip(text: str, limit: int = 80) -> str:
    """A client's value quoted back in an error, at most `limit` characters."""
    return text if len(text) <= limit else text[:limit] + "…"


def schema_error(e) -> ApiError:
    """A pydantic ValidationError of a request body as OpenAI's 400: the first problem, its field as `param`."""
    first = e.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"The request body is not valid JSON ({first['msg']})", None, "invalid_json")
    if not first["loc"]:
        return ApiError(400, "The request body must be a JSON object", None, "invalid_json")
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {clip(param)}", param, "unknown_parameter")
    return ApiError(400, f"{param}: {first['msg']}", param, "invalid_value")


async def read_body(request, limit: int) -> bytes:
    """The request's body, refused past `limit` bytes without reading the rest."""
    from starlette.requests import ClientDisconnect

    too_large = ApiError(413, f"The request body is larger than this server accepts (serve.max_body_bytes={limit})",
                         None, "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # it left, or was cut off (serve.read_timeout): this answer reaches nobody
        raise ApiError(400, "The client closed the connection before sending the whole request", None,
                       "incomplete_request") from None
    return bytes(body)


async def until_disconnected(request) -> None:
    """Returns once the client has closed its connection (the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(server: Server, max_body_bytes: int):
    """The FastAPI application of `server`; request bodies up to `max_body_bytes`."""
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse, StreamingResponse
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException

    from speedllm.generation.openai_schema import ChatRequest, CompletionRequest

    app = FastAPI(title="SpeedLLM", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # an unknown path (404) or method (405), as OpenAI answers it
        error = ApiError(e.status_code, f"{e.detail}: {request.method} {clip(request.url.path)}")
        return JSONResponse(error.body(), status_code=e.status_code, headers=e.headers)

    def check_key(request: HttpRequest) -> None:
        if server.api_key is not None and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), f"Bearer {server.api_key}".encode()):
            raise ApiError(401, "Incorrect API key provided", None, "invalid_api_key")

    async def complete(request: HttpRequest, chat: bool):
        check_key(request)
        try:
            req = (ChatRequest if chat else CompletionRequest).model_validate_json(
                await read_body(request, max_body_bytes))
        except ValidationError as e:
            raise schema_error(e) from None
        # a client that leaves before a whole (not streamed) answer cancels it: its rows are freed
        answer, gone = asyncio.ensure_future(server.respond(req, chat)), asyncio.ensure_future(
            until_disconnected(request))
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not answer.done():
            answer.cancel()
            raise ApiError(400, "The client closed the connection before the answer", None, "client_disconnected")
        result = answer.result()
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


def with_read_deadline(seconds: float):
    """uvicorn's h11 protocol, where a client must send each whole request (head and body) within `seconds` of
    connecting or of its previous answer, else its connection is closed. uvicorn sets no such limit: a client
    that stalls half-way through a request would hold its connection open forever. Also mends uvicorn's answer
    to a request that turns malformed after a good head (a bad chunk), which raised in h11 (a traceback in the
    log) whenever the application had answered or was about to answer that head."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self.watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self.watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.watch()

        def receiving(self) -> bool:
            return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

        def watch(self) -> None:
            """Arm the deadline when a request begins to be awaited; disarm it once the request is whole."""
            if self.receiving() and self.deadline is None:
                self.deadline = self.loop.call_later(seconds, self.expire)
            elif not self.receiving() and self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def expire(self) -> None:
            self.deadline = None
            if self.receiving():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            if self.cycle is not None:  # the application's answer to the head now goes nowhere, not into h11
                self.cycle.disconnected = True
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no answer begun: uvicorn's plain 400
                super().send_400_response(msg)
            else:
                self.transport.close()

    return DeadlineH11Protocol


def model_id_of(cfg: DictConfig) -> str:
    """serve.model_name, else the HF directory's name, else the model's name."""
    if cfg.serve.model_name:
        return cfg.serve.model_name
    if cfg.checkpoint.load_hf is not None:
        return Path(cfg.checkpoint.load_hf).resolve().name
    return cfg.model.name


def run(cfg: DictConfig, rt: Runtime) -> None:
    """task=serve: load the model, then serve on rank 0 (other ranks follow its steps) until SIGTERM/SIGINT."""
    import uvicorn  # the .[serve] extra, checked before launch (config.validate.check_extras)

    s = cfg.serve
    model = load_model(cfg, rt)
    max_len = min(s.max_len, max_positions(cfg.model))
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
    config = uvicorn.Config(build_app(server, s.max_body_bytes), host=s.host, port=s.port, log_level="warning",
                            http=with_read_deadline(s.read_timeout), timeout_graceful_shutdown=2)
    http = uvicorn.Server(config)
    # the slot cache: K/V of the attention layers for max_len tokens a row, a Gated DeltaNet layer's state constant
    shape, cache = cache_shape(cfg.model, tp), cache_bytes(cfg.model, s.max_batch, max_len, dtype.itemsize, tp)
    state = f" + state of {len(shape.linear_layers)} Gated DeltaNet layers" if shape.linear_layers else ""
    print(f"serving {server.model_id} on http://{s.host}:{s.port}/v1 (max_batch {s.max_batch}, "
          f"{max_len} tokens per request; cache {cache / 2**20:.1f} MiB: K/V of {len(shape.attention_layers)} "
          f"attention layers{state})", flush=True)
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


# ----------------------------------------------------------------- what task=serve declares (speedllm.planner.spec)

def extras(run):
    yield "task=serve", "fastapi", "serve"
    yield "task=serve", "uvicorn", "serve"


VALUES = {
    "serve.port": ((lambda v: 1 <= v <= 65535), "in 1..65535"),
    "serve.max_batch": at_least(1),
    "serve.max_queue": at_least(1),
    "serve.max_len": ((lambda v: v >= 2), ">= 2 (prompt + completion tokens per request)"),
    "serve.max_body_bytes": at_least(1024),
    "serve.read_timeout": ((lambda v: v > 0), "> 0 (seconds)"),
}


def workload(run) -> tuple:
    """The slots' KV cache: serve.max_batch requests of serve.max_len tokens each (speedllm.generation.batching)."""
    return min(run.serve.max_len, max_positions(run.model)), run.serve.max_batch


SPEC = replace(INFERENCE, values=VALUES, extras=extras, workload=workload,
               workload_keys="serve.max_batch, serve.max_len")
