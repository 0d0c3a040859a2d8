"""Serving throughput: 16 concurrent clients vs the same 16 requests one after another, on task=serve with the
~40M-parameter Qwen3 of benchmark `generate`, beside transformers' `generate` one by one and batched.

    python -m benchmarks serve [--clients 16] [--new-tokens 64] [--repeats 1] [--port 18123] [--dry]

The server runs in a subprocess (serve.max_batch = clients); requests are greedy /v1/completions with
token-id prompts of equal length, so transformers gets the very same inputs without padding. The modes
alternate (so load from other processes hits all alike) and each figure is the median over --repeats of
generated tokens / wall seconds. The concurrent answers are checked against the one-by-one answers.
--port 0: a free port. --dry: 2 clients, the `tiny` config.
"""

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import torch

from benchmarks.common import REPO, free_port, hf_greedy, interleaved, make_parser, model_cfg, parse
from speedllm.models.hf_adapter import hf_config
from speedllm.paths import ASSETS

PROMPT_LEN = 16


def start_server(hf_dir: Path, port: int, clients: int, run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), "task=serve", "model=hf", "hardware=cpu",
                             f"checkpoint.load_hf={hf_dir}", f"serve.port={port}", f"serve.max_batch={clients}",
                             "serve.max_len=256", "serve.model_name=bench", f"hydra.run.dir={run_dir}"])
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server failed to start")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    raise SystemExit("the server did not come up")


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--port", type=int, default=18123)
    args = parse(parser, argv, clients=2, new_tokens=4, port=0)
    port = args.port or free_port()
    from transformers import Qwen3ForCausalLM

    cfg = model_cfg("tiny", vocab_size=8192) if args.dry else model_cfg("vocab_32k")  # >= the demo tokenizer's
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_config(cfg)).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, cfg.vocab_size, (args.clients, PROMPT_LEN), generator=gen)
    print(f"model: {sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M parameters, fp32; {args.clients} requests "
          f"x {args.new_tokens} new tokens, prompts of {PROMPT_LEN} tokens")

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        hf.save_pretrained(hf_dir)
        for f in (ASSETS / "tokenizers" / "demo").iterdir():
            shutil.copy(f, hf_dir)
        proc = start_server(hf_dir, port, args.clients, Path(tmp) / "run")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=600)

        def ask(prompt):
            reply = client.completions.create(model="bench", prompt=prompt, temperature=0,
                                              max_tokens=args.new_tokens)
            return reply.choices[0].text, reply.usage.completion_tokens

        def one_by_one():
            return [ask(p) for p in prompts.tolist()]

        def concurrent():
            with ThreadPoolExecutor(args.clients) as pool:
                return list(pool.map(ask, prompts.tolist()))

        def hf_generate(batch):
            return sum(map(len, hf_greedy(hf)(batch, args.new_tokens)))

        def serve_tokens(answers):
            runs.append([text for text, _ in answers])
            return sum(n for _, n in answers)

        runs = []  # answers of the serve modes, in order
        modes = {
            "speedllm serve, one request after another": lambda: serve_tokens(one_by_one()),
            f"speedllm serve, {args.clients} concurrent clients": lambda: serve_tokens(concurrent()),
            "transformers generate, one by one": lambda: sum(hf_generate(p[None]) for p in prompts),
            f"transformers generate, batch {args.clients}": lambda: hf_generate(prompts),
        }
        try:
            ask(prompts[0].tolist())  # warm-up
            times, tokens = interleaved(modes, args.repeats)
            rates = {name: [tokens[name] / t for t in times[name]] for name in modes}
            assert all(answers == runs[0] for answers in runs), "concurrent answers differ from one-by-one answers"
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    base = statistics.median(rates["speedllm serve, one request after another"])
    print(f"{'mode':<48} {'tokens/s':>9} {'x serial':>9}")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{name:<48} {rate:>9.1f} {rate / base:>9.2f}")
    print("concurrent answers = one-by-one answers: yes")
