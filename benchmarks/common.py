"""What several benchmarks share, one home each: the command line (with its --dry form), timing and A/B
interleaving, peak memory, child processes, and the models, runners and quality measures they compare.

Letters: B batch rows, S sequence positions.
"""

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from omegaconf import OmegaConf

from benchmarks import name_of
from speedllm.models.config import ModelConfig
from speedllm.native import ISA_ENV
from speedllm.paths import CONF

REPO = Path(__file__).resolve().parents[1]  # the checkout these benchmarks belong to (launch.py, benchmarks/)
MiB, GiB = 2**20, 2**30


# --- command line


def make_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The argument parser of benchmark `module` (its __name__), its docstring as the help text."""
    return argparse.ArgumentParser(prog=f"python -m benchmarks {name_of(module)}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def parse(parser: argparse.ArgumentParser, argv, **dry) -> argparse.Namespace:
    """`argv` parsed; with --dry, `dry` replaces the defaults (arguments given still win): the benchmark's
    smallest form, which runs its whole code path in seconds on a CPU."""
    parser.add_argument("--dry", action="store_true", help="smallest form: seconds on a CPU (what the tests run)")
    parser.add_argument("--parse-only", action="store_true",
                        help="check the arguments and exit (the docs test, for every documented command)")
    args = parser.parse_args(argv)
    if args.parse_only:
        raise SystemExit(0)
    if args.dry:
        parser.set_defaults(**dry)
        args = parser.parse_args(argv)
    return args


# --- timing and interleaving

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU time, all threads


def timed(fn, clock=time.perf_counter) -> tuple:
    """(seconds one call of `fn` takes by `clock`, its result)."""
    start = clock()
    result = fn()
    return clock() - start, result


def interleaved(fns: dict, rounds: int, clock=time.perf_counter, warmup: int = 0) -> tuple:
    """Time every function of `fns` (name -> no-argument callable) once per round, in turn, so that load from
    other processes hits all of them alike; the first `warmup` rounds are not timed.

    Returns ({name: [seconds of each timed round]}, {name: result of its last call}).
    """
    times, results = {name: [] for name in fns}, {}
    for i in range(warmup + rounds):
        for name, fn in fns.items():
            seconds, results[name] = timed(fn, clock)
            if i >= warmup:
                times[name].append(seconds)
    return times, results


def on_path(path: str, fn):
    """`fn` (any arguments) run on CPU kernel path `path` (speedllm.native: "native" is SPEEDLLM_CPU_ISA unset, else
    the path it forces), the variable restored after each call."""
    def run(*args, **kwargs):
        saved = os.environ.pop(ISA_ENV, None)
        if path != "native":
            os.environ[ISA_ENV] = path
        try:
            return fn(*args, **kwargs)
        finally:
            os.environ.pop(ISA_ENV, None)
            if saved is not None:
                os.environ[ISA_ENV] = saved
    return run


# --- memory and processes


def proc_status_kib(field: str, pid="self") -> int:
    """A field of /proc/<pid>/status in KiB: VmHWM is the peak resident set size since exec (or since a reset
    through /proc/<pid>/clear_refs), VmRSS the resident set size now."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def peak_tensor_bytes(fn, module=None) -> int:
    """The peak of tensor bytes during one call of `fn` by torch's MemTracker: tensors the call allocates (saved
    activations, temporaries, gradients) and, given a `module`, its parameters and their gradients."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    if module is not None:
        tracker.track_external(module)
    with tracker:
        fn()
    return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]


def in_fresh_process(module: str, *args, env=None) -> dict:
    """Run benchmark `module` (its __name__) with `args` in a fresh process, `python -m benchmarks <name>`, and
    return the JSON object it prints as its last line; its stderr's end is the error if it fails."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", name_of(module), *map(str, args)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})})
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measured_step(cfg, world: int) -> list:
    """One record per rank of the planner's own measurement of a training step (speedllm.planner.measure) of the
    composed config `cfg`: in this process for one rank, else on `world` spawned CPU ranks."""
    from speedllm.planner.measure import measure_layout, measure_training_step
    from speedllm.runtime import Runtime

    with tempfile.TemporaryDirectory() as out:
        cfg.run_dir = out  # composed outside Hydra: its default run_dir cannot resolve
        if world == 1:
            return [measure_training_step(cfg, Runtime())]
        return measure_layout(cfg, world, out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- models

_TINY = OmegaConf.load(CONF / "model" / "qwen3_tiny.yaml")
TINY_LAYERS = {k: _TINY[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "head_dim")}  # qwen3_tiny's layers, following its config
CONFIGS = {
    # ~42M parameters each: the real Qwen3 vocabulary on qwen3_tiny's layers (38.9M of them the embedding), and
    # 8 layers x 512 hidden at vocab 32,000 (most of them in the decoder layers)
    "qwen3_vocab": dict(vocab_size=151936, **TINY_LAYERS),
    "vocab_32k": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    # --dry: every in-feature a multiple of 128 (int4's group size), so every code path runs
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
}
# 60.5M parameters (32M activated per token): vocab_32k's attention, every layer 8 experts of 384, top-2
CONFIGS["moe_60m"] = dict(CONFIGS["vocab_32k"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384,
                          norm_topk_prob=True)
BATCH, SEQ = 4, 256  # the batch the training comparisons step on


def model_cfg(name: str, **fields):
    """The ModelConfig of CONFIGS[name], tied embeddings, with `fields` (any ModelConfig field) on top."""
    return OmegaConf.merge(OmegaConf.structured(ModelConfig),
                           dict(name=name, tie_word_embeddings=True, max_position_embeddings=4096, **CONFIGS[name]),
                           fields)


def batch(vocab_size: int) -> tuple:
    """(tokens_BS, labels_BS) of the training comparisons: BATCH x SEQ random tokens (seed 1), labels shifted
    by one with -100 at the end."""
    tokens_BS = torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return tokens_BS, torch.cat([tokens_BS[:, 1:], torch.full((BATCH, 1), -100)], dim=1)


def have_torchtitan() -> bool:
    """Whether torchtitan (an optional dependency) is installed; says so when it is not."""
    try:
        import torchtitan.models.qwen3  # noqa: F401
    except ImportError as err:
        print(f"torchtitan skipped: {err} (pip install -e '.[bench]')")
        return False
    return True


def _grouped_experts_fp32(self, x_RD, num_tokens_per_expert_E):
    """torchtitan's GroupedExperts.forward without its casts to bf16 (it runs the experts in bf16 whatever the
    model's dtype: logits 0.2 off the fp32 ones, and bf16 matmuls are 50-100x slower on this CPU)."""
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h_RF = torch.nn.functional.silu(self._grouped_mm(A=x_RD, B_t=self.w1_EFD.transpose(-2, -1), offs=offsets_E))
    h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=self.w3_EFD.transpose(-2, -1), offs=offsets_E)
    return self._grouped_mm(A=h_RF, B_t=self.w2_EDF.transpose(-2, -1), offs=offsets_E)


def torchtitan_model(cfg, hf_sd: dict, max_seq_len: int):
    """torchtitan's Qwen3 for our model config `cfg` (its shipped layer builder; SDPA attention, which its
    language models otherwise reserve for other uses), holding the weights of the HF state dict `hf_sd`.
    Built on the current default device."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import (Qwen3Model, Qwen3StateDictAdapter, _build_qwen3_layers,
                                         _build_qwen3_moe_layers, _qwen3_norm)

    from speedllm.models.hf_adapter import from_hf_state_dict, to_hf_state_dict

    shape = dict(n_layers=cfg.num_hidden_layers, dim=cfg.hidden_size, n_heads=cfg.num_attention_heads,
                 n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, attn_backend="flex",
                 rope=CosSinRoPE.Config(dim=cfg.head_dim, max_seq_len=max_seq_len, theta=cfg.rope_theta))
    if cfg.num_experts:
        layers = _build_qwen3_moe_layers(**shape, moe_hidden_dim=cfg.moe_intermediate_size,
                                         num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                                         moe_comm_backend="standard")
        from torchtitan.models.common.moe import GroupedExperts

        GroupedExperts.forward = _grouped_experts_fp32
        for layer in layers:
            layer.moe.load_balance_coeff = None  # its bias is updated by a training hook we do not run
        hf_sd = to_hf_state_dict(from_hf_state_dict(hf_sd, cfg), cfg)  # experts one by one, as on disk
    else:
        layers = _build_qwen3_layers(**shape, hidden_dim=cfg.intermediate_size)
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config_tt = Qwen3Model.Config(
        vocab_size=cfg.vocab_size, dim=cfg.hidden_size, norm=_qwen3_norm(cfg.hidden_size), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=cfg.hidden_size),
        lm_head=Linear.Config(in_features=cfg.hidden_size, out_features=cfg.vocab_size), layers=layers)
    model = config_tt.build()
    model.load_state_dict(Qwen3StateDictAdapter(config_tt, None).from_hf(dict(hf_sd)))
    return model


# --- decoding


def hf_greedy(hf, **generate_kwargs):
    """fn(prompt_BS, n) -> the n greedy new token ids of each row from transformers' `generate` (EOS ignored)."""
    def generate(prompt_BS, n):
        with torch.inference_mode():
            out = hf.generate(prompt_BS, attention_mask=torch.ones_like(prompt_BS), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None, **generate_kwargs)
        return out[:, prompt_BS.shape[1]:].tolist()
    return generate


def ours_greedy(model, dtype=torch.float32, **kwargs):
    """fn(prompt_BS, n) -> the n greedy new token ids of each row from our engine (`kwargs`: generate_ids')."""
    from speedllm.generation.engine import generate_ids
    from speedllm.generation.sampling import Sampling

    return lambda prompt_BS, n: generate_ids(model, prompt_BS.tolist(), n, Sampling(), [], 0, dtype, **kwargs)


def decode_rates(runners: dict, prompt_BS, new_tokens: int, repeats: int, clock=time.perf_counter,
                 warmup: int = 1) -> tuple:
    """Greedy decode tokens/s of each runner (name -> fn(prompt_BS, n) -> ids), interleaved: rows x (new_tokens - 1)
    / (median time of new_tokens new tokens - median time of 1), i.e. the prefill subtracted out.

    Returns ({name: tokens/s}, {name: its new_tokens ids}).
    """
    fns = {(name, n): partial(fn, prompt_BS, n) for name, fn in runners.items() for n in (new_tokens, 1)}
    times, ids = interleaved(fns, repeats, clock, warmup)
    rates = {name: prompt_BS.shape[0] * (new_tokens - 1) / (statistics.median(times[name, new_tokens])
                                                           - statistics.median(times[name, 1])) for name in runners}
    return rates, {name: ids[name, new_tokens] for name in runners}


def decode_speed(ours, hf, prompt_BS, new_tokens: int, repeats: int, dtype, clock=time.perf_counter) -> tuple:
    """Greedy decode tokens/s of our engine and of transformers' static-cache `generate` on the same weights
    (decode_rates). Returns ({"transformers": tokens/s, "ours": tokens/s}, whether both generated the same ids)."""
    runners = {"transformers": hf_greedy(hf, cache_implementation="static"), "ours": ours_greedy(ours, dtype)}
    rates, ids = decode_rates(runners, prompt_BS, new_tokens, repeats, clock)
    return rates, ids["ours"] == ids["transformers"]


# --- trained checkpoints and their quality

# --dry: the training runs of the quality benchmarks, tiny and a few steps
DRY_TRAINING = ("model=qwen3_tiny", "hardware=cpu", "hardware.dtype=float32", "train.steps=4", "train.seq_len=64",
                "train.micro_batch_size=2", "train.global_batch_size=2", "train.eval_every=0", "generate.num_samples=0",
                "logging.progress_bar=false")
NEW_TOKENS, PROMPT_LEN = 32, 16  # greedy tokens compared per prompt, prompt length


def train(run_dir: Path, until: int, overrides, start: Path = None, *extra) -> Path:
    """Run launch.py into run_dir until step `until`, from its own latest checkpoint if it has one (an interrupted
    run), else from `start` (None: from scratch); returns its checkpoint at that step."""
    from speedllm.checkpoint.dcp import latest_checkpoint

    done = run_dir / "checkpoints" / f"step_{until:08d}"
    if not done.is_dir():
        load = latest_checkpoint(str(run_dir / "checkpoints")) or start
        at = 0 if load is None else int(load.name.removeprefix("step_"))
        print(f"training {run_dir.name} from step {at} to step {until}", flush=True)
        subprocess.run([sys.executable, str(REPO / "launch.py"), f"run_dir={run_dir}", "logging.tensorboard=false",
                        *overrides, *extra, f"train.stop_after={until - at}",
                        *([f"checkpoint.load={load}"] if load else [])], check=True, stdout=subprocess.DEVNULL)
    return done


def quality(runs, group_size: int, steps: int, num_prompts: int):
    """For each (checkpoint, quant) of `runs`, loaded as task=evaluate loads it, yield (valid perplexity over
    `steps` micro-batches, its relative change from the first run's, the share of NEW_TOKENS greedy tokens on
    `num_prompts` prompts (PROMPT_LEN-token openings of valid sequences) identical to the first run's)."""
    from speedllm.config import compose_config
    from speedllm.config.resolve import adopt_checkpoint_config
    from speedllm.data.loader import build_loader
    from speedllm.generation.load import load_model
    from speedllm.runtime import Runtime

    reference = base_ppl = prompts = None
    for checkpoint, quant in runs:
        cfg = compose_config("task=evaluate", f"checkpoint.load={checkpoint}", f"quant={quant}",
                             f"quant.group_size={group_size}", "run_dir=/tmp", "hardware=cpu",
                             "hardware.dtype=float32")  # each model as the fp32 original runs it
        adopt_checkpoint_config(cfg)  # the checkpoint's step directory, model and tokenizer
        model = load_model(cfg, Runtime())
        if prompts is None:
            valid = build_loader(cfg, "valid", 0, 1, num_prompts, cfg.train.seq_len, cfg.seed)
            prompts = next(iter(valid))["tokens"][:, :PROMPT_LEN]
        ce = count = 0.0
        with torch.inference_mode():
            loader = build_loader(cfg, "valid", 0, 1, cfg.train.micro_batch_size, cfg.train.seq_len, cfg.seed)
            for _, b in zip(range(steps), loader):
                loss, _ = model(b["tokens"], labels=b["labels"])
                ce, count = ce + float(loss), count + int((b["labels"] != -100).sum())
        ppl = math.exp(ce / count)
        tokens = ours_greedy(model)(prompts, NEW_TOKENS)
        reference, base_ppl = reference or tokens, base_ppl or ppl
        same = sum(a == b for r, t in zip(reference, tokens) for a, b in zip(r, t)) / (NEW_TOKENS * len(prompts))
        yield ppl, ppl / base_ppl - 1, same
