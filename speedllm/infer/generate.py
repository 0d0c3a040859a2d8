"""task=generate: complete prompts from the command line or a file with a trained or Hugging Face model.

    python launch.py task=generate checkpoint.load=outputs/<run>/checkpoints generate.prompt="ROMEO:"
    python launch.py task=generate checkpoint.load_hf=<hf dir> generate.prompts_file=prompts.txt \
        generate.output=out.jsonl generate.temperature=0.7 generate.top_p=0.9 parallel=tp2

Prompts run in batches of generate.batch_size (left-padded). Data-parallel ranks split the prompts;
tensor-parallel ranks share each batch. A single prompt streams its text as it is generated.
"""

import copy
import json
import sys
import time
from pathlib import Path
from typing import List

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from speedllm.errors import UserError
from speedllm.infer.engine import StopStrings, TextStream, generate_ids
from speedllm.infer.load import DTYPES, load_model, load_tokenizer, pad_id_of, stop_ids_of
from speedllm.infer.sampling import Sampling
from speedllm.runtime import Runtime


def read_prompts(gen: DictConfig) -> List[str]:
    """generate.prompt, or generate.prompts_file: one prompt per line, or .jsonl rows (a string or {"prompt": …})."""
    if gen.prompt is not None:
        return [str(gen.prompt)]
    if gen.prompts_file is None:
        raise UserError("task=generate needs generate.prompt=<text> or generate.prompts_file=<file, one prompt per "
                        "line or jsonl>")
    path = Path(gen.prompts_file)
    if not path.is_file():
        raise UserError(f"generate.prompts_file={path} does not exist; point it at a text or .jsonl file")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"generate.prompts_file={path} line {i}: not JSON ({e.msg}); write one JSON object or "
                            "string per line") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            row = row["prompt"]
        if not isinstance(row, str):
            raise UserError(f"generate.prompts_file={path} line {i}: expected a string or an object with a "
                            "\"prompt\" string")
        prompts.append(row)
    return prompts


def encode(tokenizer, prompt: str, gen: DictConfig) -> List[int]:
    """Token ids of a prompt, wrapped in the chat template as one user turn when generate.chat_template=true."""
    if gen.chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=gen.enable_thinking)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise UserError("generate: an empty prompt; give every prompt some text")
    return ids


def complete(model: nn.Module, tokenizer, prompts: List[str], gen: DictConfig, dtype: torch.dtype, tp: int = 1,
             stream=None) -> List[dict]:
    """Result rows {prompt, completion, completion_ids} for `prompts`, in batches of generate.batch_size."""
    stop_ids, pad_id = stop_ids_of(tokenizer), pad_id_of(tokenizer)
    stops = StopStrings(tokenizer, gen.stop) if gen.stop else None
    rows = []
    for start in range(0, len(prompts), gen.batch_size):
        batch = prompts[start:start + gen.batch_size]
        ids = generate_ids(model, [encode(tokenizer, p, gen) for p in batch], gen.max_new_tokens,
                           Sampling.from_cfg(gen), stop_ids, pad_id, dtype, seed=gen.seed + start, tp=tp,
                           stop_strings=stops, on_token=stream)
        for prompt, completion_ids in zip(batch, ids):
            text_ids = [t for t in completion_ids if t not in stop_ids]
            text = tokenizer.decode(text_ids, skip_special_tokens=True)
            rows.append({"prompt": prompt, "completion": stops.cut(text) if stops else text,
                         "completion_ids": completion_ids})
    return rows


def sample_texts(model: nn.Module, tokenizer, prompts: List[str], cfg: DictConfig) -> List[str]:
    """Greedy completions (up to generate.max_new_tokens tokens) of `prompts`, e.g. at the end of a training run.

    Every rank of a sharded model must call this with the same prompts (its forwards are collective).
    """
    from torch.distributed.fsdp import FSDPModule

    was_training = model.training
    model.eval()
    # FSDP computes in its mixed-precision dtype; a plain model in the dtype of its weights.
    dtype = DTYPES[cfg.hardware.dtype] if isinstance(model, FSDPModule) else next(model.parameters()).dtype
    gen = copy.copy(cfg.generate)
    gen.temperature, gen.stop, gen.chat_template = 0.0, [], False
    rows = complete(model, tokenizer, prompts, gen, dtype, tp=cfg.parallel.tp)
    model.train(was_training)
    return [row["completion"] for row in rows]


def gather_rows(rows: List[dict], indices: List[int]) -> List[dict]:
    """Every rank's (index, row) pairs, in prompt order (identical on all ranks)."""
    if not dist.is_initialized():
        return rows
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, list(zip(indices, rows)))
    return [row for _, row in sorted(dict(pair for part in parts for pair in part).items())]


def run(cfg: DictConfig, rt: Runtime) -> None:
    """task=generate: print completions (streaming a single prompt) and write generate.output as jsonl."""
    gen = cfg.generate
    prompts = read_prompts(gen)
    model = load_model(cfg, rt)
    tokenizer = load_tokenizer(cfg)
    dp_rank, dp_size = (rt.mesh["dp"].get_local_rank(), rt.mesh["dp"].size()) if rt.mesh is not None else (0, 1)
    indices = list(range(dp_rank, len(prompts), dp_size))
    streaming = gen.stream and len(prompts) == 1 and rt.is_main
    stream = None
    if streaming:
        print(prompts[0], end="", flush=True)
        stream = TextStream(tokenizer, lambda text: print(text, end="", flush=True),
                            stop_ids_of(tokenizer) + [pad_id_of(tokenizer)])
    start = time.perf_counter()
    rows = complete(model, tokenizer, [prompts[i] for i in indices], gen, DTYPES[cfg.hardware.dtype],
                    tp=cfg.parallel.tp, stream=stream)
    seconds = time.perf_counter() - start
    rows = gather_rows(rows, indices)
    if rt.is_main:
        report(rows, gen, seconds, streaming)
    if dist.is_initialized():
        dist.barrier()  # the other ranks wait until the output is written


def report(rows: List[dict], gen: DictConfig, seconds: float, streaming: bool) -> None:
    """Print the completions (unless streamed) and the speed; write generate.output."""
    if streaming:
        print()
    else:
        for row in rows:
            print(f"--- {row['prompt']!r}\n{row['prompt']}{row['completion']}")
    num_tokens = sum(len(row["completion_ids"]) for row in rows)
    print(f"generated {num_tokens} tokens for {len(rows)} prompt(s) in {seconds:.2f} s "
          f"({num_tokens / seconds:.1f} tokens/s)", file=sys.stderr)
    if gen.output is not None:
        out = Path(gen.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"wrote {len(rows)} rows to {out}", file=sys.stderr)
