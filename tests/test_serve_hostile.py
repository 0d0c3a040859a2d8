"""task=serve under hostile clients, started as a user starts it (launch.py on a tiny HF dir, an API key set):
dozens of malformed, mistyped, out-of-range, oversized, unauthenticated and misdirected requests each get a 4xx
with OpenAI's error JSON; clients that leave mid-stream or mid-wait free their rows; clients that stall or trickle
a request are cut off at serve.read_timeout while everyone else is served; a burst past serve.max_queue gets 503s
while the admitted requests return their lone answers; the greedy answers after all this equal those before, and
the server's log holds no traceback."""

import contextlib
import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from test_generate import DEMO_TOKENIZER
from test_serve import MODEL_ID, serving

from speedllm.data.tokenizer import load_tokenizer

pytestmark = [pytest.mark.unit, pytest.mark.slow]

KEY = "sk-hostile-test"
MAX_LEN = 4096  # the model's positions and serve.max_len
MAX_BODY = 65536
READ_TIMEOUT = 5.0
ERROR_TYPES = {"invalid_request_error", "authentication_error", "server_error"}
USER = [{"role": "user", "content": "ROMEO:"}]
DROP = object()  # a key left out of the body


def body(base: dict, **change) -> bytes:
    return json.dumps({k: v for k, v in {**base, **change}.items() if v is not DROP}).encode()


CHAT, COMPLETION = {"messages": USER, "max_tokens": 4}, {"prompt": "ROMEO:", "max_tokens": 4}
C, P = "/v1/chat/completions", "/v1/completions"

# (method, path, body, expected status, expected error param or None)
HOSTILE = [
    # not JSON, or not an object
    ("POST", C, b"{not json", 400, None),
    ("POST", C, b"", 400, None),
    ("POST", C, b"[1, 2]", 400, None),
    ("POST", C, b"null", 400, None),
    ("POST", P, b'{"prompt": "a"} trailing', 400, None),
    ("POST", C, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),  # nesting deeper than any body
    ("POST", P, b'{"prompt": "caf\xe9 \xff\xfe"}', 400, None),  # invalid UTF-8
    ("POST", P, b'{"prompt": "\\ud800"}', 400, None),  # a lone surrogate
    ("POST", P, b'{"prompt": "a", "temperature": NaN}', 400, None),
    # too large
    ("POST", P, body(COMPLETION, prompt="a" * 2 * MAX_BODY), 413, None),
    ("POST", P, iter([b'{"prompt": "', b"a" * 2 * MAX_BODY, b'"}']), 413, None),  # chunked: no Content-Length
    # integers beyond 64 bits, wrong types, out of range
    ("POST", C, body(CHAT, seed=2**70), 400, "seed"),
    ("POST", C, body(CHAT, seed=-2**70), 400, "seed"),
    ("POST", C, body(CHAT, seed="5"), 400, "seed"),
    ("POST", C, body(CHAT, seed=1.5), 400, "seed"),
    ("POST", C, body(CHAT, stream="true"), 400, "stream"),
    ("POST", C, body(CHAT, stream=1), 400, "stream"),
    ("POST", C, body(CHAT, chat_template_kwargs="enable_thinking"), 400, "chat_template_kwargs"),
    ("POST", C, body(CHAT, chat_template_kwargs={"enable_thinking": "yes"}), 400,
     "chat_template_kwargs.enable_thinking"),
    ("POST", C, body(CHAT, chat_template_kwargs={"tools": []}), 400, "chat_template_kwargs.tools"),
    ("POST", C, body(CHAT, stream=True, stream_options={"include_usage": 1}), 400, "stream_options.include_usage"),
    ("POST", C, body(CHAT, messages=DROP), 400, "messages"),
    ("POST", C, body(CHAT, messages=[]), 400, "messages"),
    ("POST", C, body(CHAT, messages="ROMEO:"), 400, "messages"),
    ("POST", C, body(CHAT, messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    ("POST", C, body(CHAT, messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("POST", C, body(CHAT, messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("POST", C, body(CHAT, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), 400,
     "messages[0].content"),
    ("POST", C, body(CHAT, temperature=-1), 400, "temperature"),
    ("POST", C, body(CHAT, temperature=3), 400, "temperature"),
    ("POST", C, body(CHAT, temperature="hot"), 400, "temperature"),
    ("POST", C, body(CHAT, temperature=1e-30), 400, "temperature"),  # would overflow the logits
    ("POST", C, body(CHAT, top_p=0), 400, "top_p"),
    ("POST", C, body(CHAT, top_p=1.5), 400, "top_p"),
    ("POST", C, body(CHAT, top_k=-5), 400, "top_k"),
    ("POST", C, body(CHAT, top_k="x"), 400, "top_k"),
    ("POST", C, body(CHAT, n=0), 400, "n"),
    ("POST", C, body(CHAT, n=10**6), 400, "n"),  # more than serve.max_queue
    ("POST", C, body(CHAT, n=True), 400, "n"),
    ("POST", C, body(CHAT, max_tokens=0), 400, "max_tokens"),
    ("POST", C, body(CHAT, max_tokens=10**30), 400, "max_tokens"),
    ("POST", C, body(CHAT, max_tokens=1.5), 400, "max_tokens"),
    ("POST", C, body(CHAT, max_completion_tokens=-1), 400, "max_completion_tokens"),
    ("POST", C, body(CHAT, stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("POST", C, body(CHAT, stop=[""]), 400, "stop"),
    ("POST", C, body(CHAT, stop=7), 400, "stop"),
    ("POST", C, body(CHAT, frequency_penalty=0.5), 400, "frequency_penalty"),  # not implemented: not ignored
    ("POST", C, body(CHAT, model="gpt-4"), 400, "model"),
    ("POST", C, body(CHAT, model=5), 400, "model"),
    ("POST", C, body(CHAT, user=["x"]), 400, "user"),
    ("POST", C, body(CHAT, messages=[{"role": "user", "content": "word " * MAX_LEN}]), 400, "messages"),  # too long
    ("POST", P, body(COMPLETION, prompt=DROP), 400, "prompt"),
    ("POST", P, body(COMPLETION, prompt=""), 400, "prompt"),
    ("POST", P, body(COMPLETION, prompt=[]), 400, "prompt"),
    ("POST", P, body(COMPLETION, prompt=[1, True]), 400, "prompt"),
    ("POST", P, body(COMPLETION, prompt=[-1]), 400, "prompt"),
    ("POST", P, body(COMPLETION, prompt=[10**6]), 400, "prompt"),  # outside the vocabulary
    ("POST", P, body(COMPLETION, prompt=[2**70]), 400, "prompt"),
    ("POST", P, body(COMPLETION, prompt=["a", "b"]), 400, "prompt"),
    ("POST", P, body(COMPLETION, prompt=[[1, 2]]), 400, "prompt"),
    ("POST", P, body(COMPLETION, prompt=[1] * (MAX_LEN + 1)), 400, "prompt"),
    ("POST", P, body(COMPLETION, prompt=[1] * (MAX_LEN - 50), max_tokens=100), 400, "max_tokens"),
    # unknown paths and methods
    ("GET", C, None, 405, None),
    ("DELETE", P, None, 405, None),
    ("POST", "/v1/models", None, 405, None),
    ("PUT", "/health", None, 405, None),
    ("GET", "/v1/embeddings", None, 404, None),
    ("POST", "/v1/../../etc/passwd", None, 404, None),
]


def assert_openai_error(response: httpx.Response, status: int, param=None) -> dict:
    assert response.status_code == status, (status, response.status_code, response.text[:300])
    answer = response.json()
    assert list(answer) == ["error"] and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    error = answer["error"]
    assert isinstance(error["message"], str) and error["message"] and error["type"] in ERROR_TYPES, error
    if param is not None:
        assert error["param"] == param, (param, error)
    return error


def raw_request(port: int, *parts: bytes) -> tuple:
    """(status, body) of the first answer to raw bytes sent in `parts`, 0.3 s apart, on a connection the server
    closes (`Connection: close`, or an answer to bytes that are not HTTP)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for i, part in enumerate(parts):
            time.sleep(0.3 * (i > 0))
            s.sendall(part)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, content = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), content


def closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the server closes `s` (having answered nothing, or a 4xx) within `seconds`."""
    s.settimeout(seconds)
    try:
        while chunk := s.recv(65536):
            assert chunk.startswith(b"HTTP/1.1 4"), chunk
    except socket.timeout:
        return False
    except ConnectionResetError:
        pass
    return True


def wait_idle(url: str, timeout: float) -> float:
    """Seconds until /health shows no running and no waiting request (pytest.fail after `timeout`)."""
    start = time.time()
    while time.time() - start < timeout:
        if httpx.get(f"{url}/health").json() == {"status": "ok", "running": 0, "waiting": 0}:
            return time.time() - start
        time.sleep(0.05)
    pytest.fail(f"the server still runs requests {timeout} s on: {httpx.get(f'{url}/health').json()}")


def test_hostile_clients_get_4xx_and_others_their_unchanged_answers(tmp_path, save_tiny_hf):
    path = tmp_path
    save_tiny_hf(path, seed=9, vocab_size=len(load_tokenizer(str(DEMO_TOKENIZER))), tie_word_embeddings=True,
                 max_position_embeddings=MAX_LEN)
    with serving(path, f"serve.api_key={KEY}", "serve.max_batch=2", "serve.max_queue=2", f"serve.max_len={MAX_LEN}",
                 f"serve.max_body_bytes={MAX_BODY}", f"serve.read_timeout={READ_TIMEOUT}") as (proc, url, _):
        port = int(url.rsplit(":", 1)[1])
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)

        def answers():
            chat = client.chat.completions.create(model=MODEL_ID, messages=USER, temperature=0, max_tokens=12)
            done = client.completions.create(model=MODEL_ID, prompt="KING HENRY:\nWhat say you", temperature=0,
                                             max_tokens=12)
            stream = client.chat.completions.create(model=MODEL_ID, messages=USER, temperature=0, max_tokens=12,
                                                    stream=True)
            return chat.choices[0].message.content, done.choices[0].text, "".join(
                c.choices[0].delta.content or "" for c in stream)

        before = answers()
        assert all(before)

        # --- keys: missing, wrong, malformed; on every endpoint that needs one
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"bearer {KEY}x"}]:
            for method, where, content in [("POST", C, body(CHAT)), ("POST", P, body(COMPLETION)),
                                           ("GET", "/v1/models", None)]:
                response = httpx.request(method, f"{url}{where}", content=content, headers=headers)
                assert assert_openai_error(response, 401)["type"] == "authentication_error"

        # --- malformed, mistyped, out of range, too large, misdirected: each a 4xx in OpenAI's shape
        for method, where, content, status, param in HOSTILE:
            assert_openai_error(http.request(method, where, content=content), status, param)
        status, content = raw_request(port, f"POST {P} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                                            f"Content-Length: {10**12}\r\nConnection: close\r\n\r\n".encode())
        assert status == 413 and json.loads(content)["error"]["code"] == "request_too_large"
        post = f"POST {P} HTTP/1.1\r\nHost: x\r\n".encode()
        chunked, bad_chunk = post + b"Transfer-Encoding: chunked\r\n\r\n", b"ZZ\r\nabc\r\n"
        for garbage in [[b"NOT HTTP AT ALL\r\n\r\n"], [post + b"Content-Length: abc\r\n\r\n"],
                        [chunked + bad_chunk]]:  # the app starts on the head (to answer 401) as uvicorn answers 400
            assert raw_request(port, *garbage)[0] == 400  # not HTTP: no request to answer in JSON, uvicorn's 400
        assert raw_request(port, chunked, bad_chunk)[0] == 401  # the app answered the head before the bad chunk

        # --- stalled and trickling clients: others are served meanwhile; each is cut off at serve.read_timeout
        stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        stalled[0].sendall(f"POST {P} HTTP/1.1\r\nHost: x\r\n".encode())  # half a head
        stalled[1].sendall(f"POST {P} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 100"
                           f"\r\n\r\n{{\"prompt\": ".encode())  # half a body
        start = time.time()
        served = answers()
        assert time.time() - start < READ_TIMEOUT and served == before
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n":  # a byte every 0.2 s: still too slow
            try:
                stalled[2].sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.2)
        assert all(closed_within(s, READ_TIMEOUT + 3) for s in stalled)
        for s in stalled:
            s.close()

        # --- a burst past serve.max_queue (2 rows, 2 waiting) while two long streams hold both rows: 2 wait, the
        # rest get 503s at once; the holders leave mid-stream, their rows are freed, the 2 waiting get their lone answers
        prompts = [f"{name}:\nThe {word}" for name, word in zip(["ROMEO", "JULIET", "KING"] * 3,
                                                               "king queen lord lady sword crown night day".split())]
        short = dict(model=MODEL_ID, temperature=0, max_tokens=16)
        alone = {p: client.completions.create(prompt=p, **short).choices[0].text for p in prompts}
        # a stop string makes every step decode the whole text so far: these would run for a minute
        long = dict(model=MODEL_ID, prompt="ROMEO:", temperature=0, max_tokens=MAX_LEN - 16,
                    stop=["never appears in this text"])
        with ThreadPoolExecutor(len(prompts)) as pool, contextlib.ExitStack() as holders:
            lines = [holders.enter_context(client.completions.with_streaming_response.create(stream=True, **long))
                     .iter_lines() for _ in range(2)]
            assert all(next(it).startswith("data: ") for it in lines)  # (an iterator let go would close its stream)
            assert httpx.get(f"{url}/health").json()["running"] == 2
            burst = [pool.submit(lambda p=p: http.post(P, json={"prompt": p, **short})) for p in prompts]
            deadline = time.time() + 30
            while sum(f.done() for f in burst) < len(prompts) - 2 or httpx.get(f"{url}/health").json() != \
                    {"status": "ok", "running": 2, "waiting": 2}:
                assert time.time() < deadline
                time.sleep(0.05)
        assert wait_idle(url, 10) < 5  # the holders' rows were freed: the 2 waiting ran and finished
        busy = [f.result() for f in burst if f.result().status_code == 503]
        assert all(assert_openai_error(r, 503)["code"] == "queue_full" for r in busy)
        assert len(busy) == len(prompts) - 2
        assert all(f.result().json()["choices"][0]["text"] == alone[p] for p, f in zip(prompts, burst)
                   if f.result().status_code == 200)

        # --- a client that leaves while waiting for a whole (not streamed) answer frees its row too
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=0.5).completions.create(**long)
        assert wait_idle(url, 10) < 3

        # --- after all that: the same answers, nothing left running
        assert answers() == before
        assert wait_idle(url, 5) < 1
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-3000:]
    log = out + err + (path / "run" / "launch.log").read_text()
    assert "server stopped" in out
    for bad in ["Traceback", "internal error", "Exception in ASGI"]:
        assert bad not in log, log[-3000:]
