"""Continuous batching: requests joining and leaving a running batch get exactly what they get alone."""

import threading

import torch

from speedllm.generation.batching import Batcher, Request
from speedllm.generation.engine import generate_ids
from speedllm.generation.sampling import Sampling


def run_requests(model, requests, max_batch, stop_ids=()):
    """Submit all requests to a batcher thread and wait until each has finished."""
    batcher = Batcher(model, None, stop_ids, max_batch=max_batch, max_len=64, max_queue=len(requests),
                      dtype=torch.float32)
    done = threading.Semaphore(0)
    for r in requests:
        r.on_event = lambda token, done=done: token is None and done.release()
    thread = threading.Thread(target=batcher.run)
    thread.start()
    for r in requests:
        batcher.submit([r])
    for _ in requests:
        assert done.acquire(timeout=60)
    batcher.stop()
    thread.join(timeout=10)
    return batcher


def test_rows_joining_and_leaving_match_single_request_generation(hf_pair):
    cfg, _, ours = hf_pair(seed=3)
    gen = torch.Generator().manual_seed(4)
    lengths, budgets = (6, 11, 1, 8, 3, 9, 5), (12, 5, 9, 16, 7, 3, 10)
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    sampled = Sampling(temperature=1.0, top_k=20, top_p=0.9)
    settings = [(Sampling(), None) if i % 2 == 0 else (sampled, 100 + i) for i in range(len(prompts))]
    expected = [generate_ids(ours, [p], n, s, [], 0, torch.float32, seed=seed or 0)[0]
                for p, n, (s, seed) in zip(prompts, budgets, settings)]
    # 3 rows for 7 requests: later ones wait, join as earlier ones leave, and rows move to stay contiguous
    requests = [Request(p, n, s, seed) for p, n, (s, seed) in zip(prompts, budgets, settings)]
    run_requests(ours, requests, max_batch=3)
    assert [r.out_ids for r in requests] == expected
    assert all(r.finish_reason == "length" for r in requests)


def test_stop_ids_end_one_row_and_free_it(hf_pair):
    _, _, ours = hf_pair(seed=5)
    prompts = [[5, 6, 7], [9, 10, 11, 12], [3, 4], [20, 21, 22]]
    free = [generate_ids(ours, [p], 12, Sampling(), [], 0, torch.float32)[0] for p in prompts]
    eos = free[1][3]
    expected = [generate_ids(ours, [p], 12, Sampling(), [eos], 0, torch.float32)[0] for p in prompts]
    requests = [Request(p, 12) for p in prompts]
    run_requests(ours, requests, max_batch=2, stop_ids=[eos])
    assert [r.out_ids for r in requests] == expected
    assert requests[1].finish_reason == "stop" and requests[1].out_ids[-1] == eos
