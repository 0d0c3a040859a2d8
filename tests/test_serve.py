"""task=serve through the official `openai` client: greedy answers equal transformers' greedy generate on the
rendered prompt (which tests/test_generate.py holds equal to task=generate), streaming gives the same text,
usage is exact, bad requests get OpenAI-shaped 400s, concurrent clients get their single-request answers (in bf16 too, in batch-invariant mode), a
client leaving mid-stream frees its row, SIGTERM stops the server."""

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from test_generate import DEMO_TOKENIZER, hf_greedy, stop_ids

from speedllm.data.tokenizer import load_tokenizer
from speedllm.generation.batching import Batcher
from speedllm.generation.openai_schema import CompletionRequest
from speedllm.paths import ROOT
from speedllm.tasks.serve import ApiError, Server, build_app

pytestmark = pytest.mark.numerics

MODEL_ID = "tiny-qwen3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url, proc, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not come up")


@contextlib.contextmanager
def serving(path, *overrides):
    """task=serve on the HF dir in a subprocess (its own session): (process, base url, openai client). A port
    another process takes between free_port() and the server's bind (the other xdist worker's ranks) is given up
    for a new one."""
    for attempt in range(3):
        port = free_port()
        # float32: answers are compared across batch compositions (bf16's rounding depends on them)
        proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "task=serve", "model=hf", "hardware=cpu",
                                 "hardware.dtype=float32", f"checkpoint.load_hf={path}", f"serve.port={port}",
                                 f"serve.model_name={MODEL_ID}", "serve.max_batch=8", "serve.max_len=128",
                                 f"hydra.run.dir={path}/run", *overrides],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=path,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            break
        except BaseException as err:
            if proc.poll() is None:  # it never came up: stop it before going on
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
            if not isinstance(err, AssertionError) or "address already in use" not in str(err) or attempt == 2:
                raise
    try:
        yield proc, url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.fixture(scope="module")
def server(hf_dir):
    path, hf, tok = hf_dir
    with serving(path) as (proc, url, client):
        yield proc, url, client, hf, tok


def chat_ids(tok, content):
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    return tok.encode(text, add_special_tokens=False)


def text_of(tok, ids):
    return tok.decode([t for t in ids if t not in stop_ids(tok)], skip_special_tokens=True)


def test_greedy_chat_streaming_and_usage(server):
    _, _, client, hf, tok = server
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    prompt_ids = chat_ids(tok, "ROMEO:")
    (expected,) = hf_greedy(hf, [prompt_ids], 20, eos=stop_ids(tok))
    messages = [{"role": "user", "content": "ROMEO:"}]
    reply = client.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=20)
    assert reply.choices[0].message.content == text_of(tok, expected)
    assert reply.choices[0].finish_reason == ("stop" if expected[-1] in stop_ids(tok) else "length")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), len(expected))
    assert reply.usage.total_tokens == len(prompt_ids) + len(expected)

    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == reply.choices[0].message.content
    assert sum(1 for p in pieces if p) > 1
    assert chunks[-1].usage.completion_tokens == len(expected)

    # Qwen3's thinking switch reaches the chat template
    thinking = client.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=1,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert thinking.usage.prompt_tokens == len(prompt_ids) - len(tok.encode("<think>\n\n</think>\n\n",
                                                                            add_special_tokens=False))


def test_completions_with_stop_string_and_seed(server):
    _, _, client, hf, tok = server
    prompt_ids = tok.encode("KING HENRY:\nWhat say you", add_special_tokens=False)
    (expected,) = hf_greedy(hf, [prompt_ids], 16, eos=stop_ids(tok))
    full = text_of(tok, expected)
    reply = client.completions.create(model=MODEL_ID, prompt="KING HENRY:\nWhat say you", temperature=0,
                                      max_tokens=16)
    assert reply.choices[0].text == full
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = client.completions.create(model=MODEL_ID, prompt="KING HENRY:\nWhat say you", temperature=0,
                                    max_tokens=16, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL_ID, prompt="KING HENRY:\nWhat say you", temperature=0,
                                         max_tokens=16, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    # sampling with a seed: n choices, reproducible, different seeds differ
    kwargs = dict(model=MODEL_ID, prompt="ROMEO:", temperature=1.0, top_p=0.9, max_tokens=12, n=2,
                  extra_body={"top_k": 40})
    a = client.completions.create(seed=7, **kwargs)
    b = client.completions.create(seed=7, **kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text and a.usage.completion_tokens == 24


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    _, url, client, _, _ = server
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="gpt-4", messages=messages)
    assert e.value.status_code == 400 and e.value.code == "model_not_found" and "gpt-4" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_ID, prompt="word " * 200, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    for bad in [dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(top_k="x")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_ID, messages=messages, extra_body=bad)
        assert e.value.body["param"] == next(iter(bad)) and e.value.body["type"] == "invalid_request_error"
    assert httpx.post(f"{url}/v1/completions", content=b"{not json").status_code == 400
    reply = client.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=3)
    assert reply.usage.completion_tokens >= 1


def answers_alone_and_together(client):
    """16 clients at once (8 rows: half wait, then join as rows free up) and each prompt sent alone."""
    words = "king queen lord lady sword crown night day love hate war peace heaven earth fire water".split()
    prompts = [f"{name}:\nThe {word}" for name, word in zip(("ROMEO", "JULIET", "KING", "First Citizen") * 4, words)]

    def ask(prompt):
        reply = client.completions.create(model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=16)
        return reply.choices[0].text, reply.usage.completion_tokens

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    assert len(set(alone)) > 8
    return alone, together


def test_concurrent_clients_get_their_single_request_answers(server):
    alone, together = answers_alone_and_together(server[2])
    assert together == alone


def test_bf16_answers_do_not_depend_on_the_batch_in_batch_invariant_mode(hf_dir):
    """In bf16 a greedy answer can change with the requests batched beside it (the GEMMs' and attention's summation
    order follows the batch's rows and the cache's length); hardware.batch_invariant=true fixes that order, so
    each concurrent answer equals the same request sent alone, as in float32."""
    path, _, _ = hf_dir
    with serving(path, "hardware.dtype=bfloat16", "hardware.batch_invariant=true") as (_, _, client):
        alone, together = answers_alone_and_together(client)
    assert together == alone


def test_a_client_leaving_mid_stream_frees_its_row(server):
    _, url, client, _, _ = server
    body = {"model": MODEL_ID, "prompt": "ROMEO:", "temperature": 0, "max_tokens": 120, "stream": True,
            "stop": ["never appears in this text"]}  # a stop string: every step decodes, the stream lasts
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # it is running: leave without reading the rest
    reply = client.completions.create(model=MODEL_ID, prompt="JULIET:", temperature=0, max_tokens=4)
    assert reply.usage.completion_tokens == 4
    deadline = time.time() + 30
    while httpx.get(f"{url}/health").json()["running"] and time.time() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "running": 0, "waiting": 0}


def test_sigterm_stops_the_server(server):
    proc = server[0]
    start = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert time.time() - start < 10
    assert "server stopped" in out


def test_a_full_queue_answers_503(hf_pair):
    """Requests wait while the batcher is not stepping; one past serve.max_queue gets a 503."""
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    _, _, ours = hf_pair(seed=1, vocab_size=len(tok))
    batcher = Batcher(ours, tok, stop_ids(tok), max_batch=1, max_len=32, max_queue=2, dtype=torch.float32)
    server = Server(batcher, tok, MODEL_ID, 32, None, False)

    async def submit_three():
        body = CompletionRequest(prompt="ROMEO:", max_tokens=4, stream=True)
        await server.respond(body, chat=False)
        await server.respond(body, chat=False)
        with pytest.raises(ApiError) as e:
            await server.respond(body, chat=False)
        return e.value

    error = asyncio.run(submit_three())
    assert error.status == 503 and error.body()["error"]["code"] == "queue_full"
    assert batcher.num_waiting == 2


def test_api_key_is_required_when_set(hf_pair):
    from fastapi.testclient import TestClient

    tok = load_tokenizer(str(DEMO_TOKENIZER))
    _, _, ours = hf_pair(seed=1, vocab_size=len(tok))
    batcher = Batcher(ours, tok, stop_ids(tok), max_batch=1, max_len=32, max_queue=2, dtype=torch.float32)
    http = TestClient(build_app(Server(batcher, tok, MODEL_ID, 32, "s3cret", False), max_body_bytes=4096))
    response = http.get("/v1/models")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    response = http.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert response.status_code == 200 and response.json()["data"][0]["id"] == MODEL_ID
    assert http.get("/health").status_code == 200  # health checks need no key


def session_alive(sid) -> bool:
    return subprocess.run(["pgrep", "-s", str(sid)], capture_output=True).returncode == 0


@pytest.mark.slow
def test_tp2_serves_the_single_process_answers_and_stops_on_sigterm(hf_dir):
    path, hf, tok = hf_dir
    prompts = ["ROMEO:", "KING HENRY:\nWhat say you"]
    expected = [text_of(tok, hf_greedy(hf, [tok.encode(p, add_special_tokens=False)], 12, eos=stop_ids(tok))[0])
                for p in prompts]
    with serving(path, "parallel=tp2") as (proc, _, client):
        with ThreadPoolExecutor(2) as pool:  # together: rank 0 sends the other rank batched steps
            answers = list(pool.map(lambda p: client.completions.create(
                model=MODEL_ID, prompt=p, temperature=0, max_tokens=12).choices[0].text, prompts))
        assert answers == expected
        start = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        while session_alive(proc.pid) and time.time() - start < 30:
            time.sleep(0.2)
        assert not session_alive(proc.pid) and time.time() - start < 15


def test_a_chat_template_that_refuses_the_messages_is_a_400(hf_pair):
    """A model's own template may raise on a conversation it does not take (e.g. no user turn): the client's 400."""
    from fastapi.testclient import TestClient

    tok = load_tokenizer(str(DEMO_TOKENIZER))
    tok.chat_template = "{% if messages[-1].role != 'user' %}{{ raise_exception('No user query found') }}{% endif %}"
    _, _, ours = hf_pair(seed=1, vocab_size=len(tok))
    batcher = Batcher(ours, tok, stop_ids(tok), max_batch=1, max_len=32, max_queue=2, dtype=torch.float32)
    http = TestClient(build_app(Server(batcher, tok, MODEL_ID, 32, None, False), max_body_bytes=4096))
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "be brief"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "No user query found" in response.json()["error"]["message"]
