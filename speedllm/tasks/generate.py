"""task=generate: complete prompts from the command line or a file with a trained or Hugging Face model.

    python launch.py task=generate checkpoint.load=outputs/<run>/checkpoints generate.prompt="ROMEO:"
    python launch.py task=generate checkpoint.load_hf=<hf dir> generate.prompts_file=prompts.txt \
        generate.output=out.jsonl generate.temperature=0.7 generate.top_p=0.9 parallel=tp2

Prompts run in batches of generate.batch_size (left-padded). Data-parallel ranks split the prompts;
tensor-parallel ranks share each batch. A single prompt streams its text as it is generated.
"""

import json
import sys
import time
from pathlib import Path
from typing import List

import torch.distributed as dist
from omegaconf import DictConfig

from speedllm.data.tokenizer import pad_id_of, stop_ids_of, tokenizer_for
from speedllm.errors import UserError
from speedllm.generation.complete import complete, encode
from speedllm.generation.engine import Detokenizer
from speedllm.generation.load import load_model
from speedllm.hardware import DTYPES
from speedllm.models.rope import max_positions
from speedllm.planner.spec import INFERENCE
from speedllm.runtime import Runtime
from speedllm.storage import write_text_atomic


def read_prompts(gen: DictConfig) -> List[str]:
    """generate.prompt, or generate.prompts_file: one prompt per line, or .jsonl rows (a string or {"prompt": …})."""
    if gen.prompt == "-":
        text = sys.stdin.read().rstrip("\n")
        if not text.strip():
            raise UserError("generate.prompt=- read an empty prompt from stdin; pipe some text in")
        return [text]
    if gen.prompt is not None:
        return [str(gen.prompt)]
    if gen.prompts_file is None:
        raise UserError("task=generate needs generate.prompt=<text> or generate.prompts_file=<file, one prompt per "
                        "line or jsonl>")
    path = Path(gen.prompts_file)
    if not path.is_file():
        raise UserError(f"generate.prompts_file={path} does not exist; point it at a text or .jsonl file")
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as e:
        raise UserError(f"generate.prompts_file={path} is not UTF-8 text (byte {e.start}); re-encode it as UTF-8") \
            from None
    if not lines:
        raise UserError(f"generate.prompts_file={path} holds no prompts; write one prompt per line (or jsonl)")
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
    tokenizer = tokenizer_for(cfg)
    longest = max(len(encode(tokenizer, p, gen)) for p in prompts)
    limit = max_positions(cfg.model)
    if longest + gen.max_new_tokens > limit and rt.is_main:
        print(f"warning: a prompt of {longest} tokens + generate.max_new_tokens={gen.max_new_tokens} goes past the "
              f"{limit} positions the model takes (model.max_position_embeddings); its completion stops after "
              f"{max(limit - longest, 0)} new tokens", file=sys.stderr)
    dp_rank, dp_size = (rt.mesh["dp"].get_local_rank(), rt.mesh["dp"].size()) if rt.mesh is not None else (0, 1)
    indices = list(range(dp_rank, len(prompts), dp_size))
    streaming = gen.stream and len(prompts) == 1 and rt.is_main
    stream = None
    if streaming:
        print(prompts[0], end="", flush=True)
        detok = Detokenizer(tokenizer, stop_ids_of(tokenizer) + [pad_id_of(tokenizer)], [])
        stream = lambda token: print(detok.add(token), end="", flush=True)  # noqa: E731
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
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        write_text_atomic(out, text, "generate.output")
        print(f"wrote {len(rows)} rows to {out}", file=sys.stderr)


SPEC = INFERENCE  # a trained model under tensor and data parallelism (speedllm.planner.spec)
