"""task=evaluate evaluate.tasks=[...]: lm-eval's task suites with our model as an lm-eval backend.

    python launch.py task=evaluate checkpoint.load=<run>/checkpoints evaluate.tasks=[hellaswag,gsm8k]
    python launch.py task=evaluate model=hf checkpoint.load_hf=<HF dir> evaluate.tasks=[my_task] \
        evaluate.include_path=<dir of task YAMLs> evaluate.num_fewshot=5 evaluate.limit=100

`SpeedLM` is an lm-eval `TemplateLM`: loglikelihoods score right-padded batches in one forward each (a causal
model needs no mask for padding at the end), rolling loglikelihoods use lm-eval's own windows, and
generate_until runs on the continuous batcher. It computes what lm-eval's HF backend (HFLM) computes, so
scores are comparable with published lm-eval numbers. Under tensor parallelism every rank runs the same
evaluation (the forwards are collective); rank 0 prints lm-eval's table and writes <run_dir>/eval.json.
"""

import json
from pathlib import Path
from typing import List, Tuple

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from omegaconf import DictConfig

from speedllm.data.tokenizer import tokenizer_for
from speedllm.errors import UserError
from speedllm.generation.batching import Batcher, Request
from speedllm.generation.engine import StopStrings, keep_positions
from speedllm.generation.load import DTYPES, load_model
from speedllm.generation.sampling import Sampling
from speedllm.models.rope import max_positions
from speedllm.runtime import Runtime

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF backend default


class SpeedLM(TemplateLM):
    """Our Qwen3 (any tensor-parallel layout) behind lm-eval's model interface.

    Args:
        max_length: tokens a sequence may have (the model's context); longer inputs lose their left part.
        batch_size: sequences per forward (loglikelihoods) and rows of the batcher (generation).
    """

    def __init__(self, model, tokenizer, max_length: int, batch_size: int, dtype: torch.dtype, tp: int = 1,
                 seed: int = 0):
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self._max_length, self.batch_size, self.dtype = max_length, batch_size, dtype
        self.tp, self.seed = tp, seed

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> List[int]:
        if add_special_tokens is None:  # the tokenizer's own default, as HFLM
            return self.tokenizer.encode(string)
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding would produce it) per request."""
        sequences = []
        for _, context_enc, continuation_enc in requests:
            tokens = (context_enc + continuation_enc)[-(self.max_length + 1):][:-1]
            sequences.append((tokens, continuation_enc))
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))  # similar lengths together
        results = [None] * len(sequences)
        for start in range(0, len(order), self.batch_size):
            batch = [sequences[i] for i in order[start:start + self.batch_size]]
            S = len(batch[0][0])
            tokens_BS = torch.full((len(batch), S), self.eot_token_id, dtype=torch.long)
            for b, (tokens, _) in enumerate(batch):
                tokens_BS[b, :len(tokens)] = torch.tensor(tokens)
            first = min(len(tokens) - len(cont) for tokens, cont in batch)  # the earliest position scored
            with keep_positions(self.model, slice(first, None)):
                logits_BSV = self.model(tokens_BS.to(next(self.model.parameters()).device))
            logprobs_BSV = torch.log_softmax(logits_BSV.float(), dim=-1)
            for b, (tokens, cont) in enumerate(batch):
                end = len(tokens) - first
                rows = logprobs_BSV[b, end - len(cont):end]
                cont_t = torch.tensor(cont, device=rows.device)
                logprob = float(rows.gather(-1, cont_t[:, None]).sum())
                results[order[start + b]] = (logprob, bool((rows.argmax(-1) == cont_t).all()))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """Log-likelihood of whole texts, in lm-eval's disjoint windows of max_length tokens."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Completions on the continuous batcher, each ending at eos, its `until` strings or max_gen_toks."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        eot = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        jobs = []
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eot)
            max_new = kwargs["max_gen_toks"]
            sampling = Sampling(float(kwargs.get("temperature", 0.0)), int(kwargs.get("top_k") or 0),
                                float(kwargs.get("top_p") or 1.0)) if kwargs["do_sample"] else Sampling()
            prompt = self.tok_encode(context)[-(self.max_length - max_new):]
            jobs.append(Request(prompt, max_new, sampling, seed=self.seed + i, stop=until))
        if not jobs:
            return []
        max_len = max(len(r.prompt_ids) + r.max_new_tokens for r in jobs)
        batcher = Batcher(self.model, self.tokenizer, [self.eot_token_id], self.batch_size, max_len, len(jobs),
                          self.dtype, self.tp)
        batcher.submit(jobs)
        while any(r.finish_reason is None for r in jobs):
            batcher.step()
        return [StopStrings(self.tokenizer, r.stop).cut(self.tokenizer.decode(r.out_ids, skip_special_tokens=True))
                for r in jobs]


def run(cfg: DictConfig, rt: Runtime) -> None:
    """Evaluate evaluate.tasks with lm-eval; print its table, write <run_dir>/eval.json (lm-eval's results)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    ev = cfg.evaluate
    manager = None
    if ev.include_path is not None:  # indexing lm-eval's thousands of built-in tasks takes ~a minute: skip it
        manager = TaskManager(include_path=ev.include_path, include_defaults=False)
    if manager is None or any(t not in manager.all_tasks for t in ev.tasks):
        manager = TaskManager(include_path=ev.include_path)
    unknown = [t for t in ev.tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"evaluate.tasks: lm-eval knows no task {', '.join(unknown)}; check the names (lm-eval "
                        "--tasks list) or add their YAMLs with evaluate.include_path=<dir>")
    model = load_model(cfg, rt)
    lm = SpeedLM(model, tokenizer_for(cfg), max_positions(cfg.model), ev.batch_size,
                 DTYPES[cfg.hardware.dtype], cfg.parallel.tp, cfg.seed)
    out = simple_evaluate(model=lm, tasks=list(ev.tasks), num_fewshot=ev.num_fewshot, limit=ev.limit,
                          task_manager=manager, log_samples=False, random_seed=cfg.seed,
                          numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed)
    if rt.is_main:
        print(make_table(out))
        path = Path(cfg.run_dir) / "eval.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=2, default=str) + "\n")
        print(f"wrote {path}")
