"""GRPO steps/s: our `task=grpo` against TRL's `GRPOTrainer`, same model, prompts, reward and settings.

    python -m benchmarks grpo [--steps 6] [--prompts 8] [--group 8] [--new-tokens 16] [--dtype bfloat16]
                              [--batch-invariant] [--dry]

One small Qwen3 (random weights: hidden 256, 4 layers, the demo tokenizer's 8,192-token vocabulary, tied), saved
by transformers with the demo tokenizer beside it; `data=rl_demo`'s prompts in order; the `math_answer` reward
(speedllm.train.rewards, TRL's reward-function signature, so both call the same function); a step samples
--group completions of each of --prompts prompts (temperature 1, --new-tokens at most) and takes one AdamW step
on them (GRPO loss, no KL: neither builds a reference model; gradient clipping at 1.0). Each system runs as it
ships, alone in its own process, with torch's default threads:
  ours   `python launch.py task=grpo model=hf checkpoint.load_hf=<dir> data=rl_demo ...` (the rollout through our
         KV cache on the training model, then the update); a step's wall time is its `rl/step_s` in metrics.jsonl
  trl    GRPOTrainer(model=<dir>, reward_funcs=math_answer, GRPOConfig(per_device_train_batch_size=prompts x group,
         num_generations=group, max_completion_length=new tokens, beta=0, use_cpu=True, bf16 per --dtype)):
         transformers' generate, then its loss; a step's wall time is between consecutive on_step_end callbacks
The first step of each (start-up, first allocations) is not counted; the median of the rest is reported, with
each process's peak resident set size (ru_maxrss: the Python runtime and its imports included).
--batch-invariant: ours with hardware.batch_invariant=true (rollout and training log-probabilities bit-identical;
TRL has no such mode). --dry: 2 steps of 2 prompts x 2 completions, 4 new tokens, a 2-layer model.
"""

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_quant_memory import CHILD_PEAK
from benchmarks.common import REPO, GiB, make_parser, parse
from speedllm.paths import ASSETS

DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"
PROMPTS = ASSETS / "rl_demo" / "prompts.jsonl"
LR = 1e-5


def save_model(path: Path, layers: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    Qwen3ForCausalLM(config).save_pretrained(path)
    for file in DEMO_TOKENIZER.iterdir():
        shutil.copy(file, path / file.name)


def ours(model: Path, run_dir: Path, args) -> tuple:
    """Seconds per step of our task=grpo (its rl/step_s) and the launch process's peak RSS in GiB."""
    argv = [str(REPO / "launch.py"), "task=grpo", "model=hf", f"checkpoint.load_hf={model}", "data=rl_demo",
            "hardware=cpu", f"hardware.dtype={args.dtype}", f"hydra.run.dir={run_dir}", f"train.steps={args.steps}",
            f"rl.prompts_per_step={args.prompts}", f"rl.group_size={args.group}",
            f"rl.max_new_tokens={args.new_tokens}", f"optim.lr={LR}", "optim.min_lr=0", "optim.warmup_steps=0",
            "optim.schedule=constant", "rl.rewards=[{_target_: speedllm.train.rewards.math_answer, weight: 1.0}]",
            "checkpoint.save_final=false", "logging.progress_bar=false", "logging.tensorboard=false",
            "train.log_every=1000", f"hardware.batch_invariant={str(args.batch_invariant).lower()}"]
    out = subprocess.run([sys.executable, "-c", CHILD_PEAK, sys.executable, *argv],
                         check=True, capture_output=True, text=True, cwd=run_dir.parent)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    peak = int(out.stdout.split()[-1]) * 1024 / GiB  # ru_maxrss is in KiB
    return [row["rl/step_s"] for row in rows if "rl/step_s" in row], peak


def trl(model: Path, out_dir: Path, args) -> tuple:
    """Seconds per step of TRL's GRPOTrainer and this process's peak RSS in GiB."""
    import resource

    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from speedllm.train.rewards import math_answer

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = [time.perf_counter()]

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter())

    dataset = load_dataset("json", data_files=str(PROMPTS), split="train")
    config = GRPOConfig(output_dir=str(out_dir), per_device_train_batch_size=args.prompts * args.group,
                        num_generations=args.group, max_completion_length=args.new_tokens, temperature=1.0, beta=0.0,
                        learning_rate=LR, lr_scheduler_type="constant", max_steps=args.steps, use_cpu=True,
                        bf16=args.dtype == "bfloat16", report_to=[], logging_steps=1, save_strategy="no",
                        shuffle_dataset=False, seed=0)
    clock = Clock()
    trainer = GRPOTrainer(model=str(model), reward_funcs=math_answer, args=config, train_dataset=dataset,
                          callbacks=[clock])
    clock.times = [time.perf_counter()]
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # ru_maxrss is in KiB
    return [b - a for a, b in zip(clock.times, clock.times[1:])], peak


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch-invariant", action="store_true", help="ours in batch-invariant mode")
    parser.add_argument("--child", choices=["trl"], help="(internal) run TRL in this process")
    parser.add_argument("--model", help="(internal) the saved model")
    parser.add_argument("--out", help="(internal) TRL's output directory")
    args = parse(parser, argv, steps=2, prompts=2, group=2, new_tokens=4, layers=2)
    if args.child:
        print(json.dumps(trl(Path(args.model), Path(args.out), args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_model(tmp / "model", args.layers)
        runs = {"ours": ours(tmp / "model", tmp / "ours", args)}
        child = subprocess.run([sys.executable, "-m", "benchmarks", "grpo", "--child", "trl", "--model",
                                str(tmp / "model"), "--out", str(tmp / "trl"), *(argv or [])],
                               check=True, capture_output=True, text=True, cwd=REPO)
        runs["trl"] = json.loads(child.stdout.strip().splitlines()[-1])
    counted = {name: t[1:] or t for name, (t, _) in runs.items()}
    print(f"\ngrpo: {args.prompts} prompts x {args.group} completions, <= {args.new_tokens} new tokens, {args.layers} "
          f"layers x 256, {args.dtype}, {len(runs['ours'][0])} steps (first not counted)"
          + (", ours batch-invariant" if args.batch_invariant else ""))
    print("| system | s/step (median) | steps/s | peak RSS GiB |\n|---|---|---|---|")
    for name, t in counted.items():
        print(f"| {name} | {statistics.median(t):.3f} | {1 / statistics.median(t):.2f} | {runs[name][1]:.2f} |")
    ratio = statistics.median(counted["trl"]) / statistics.median(counted["ours"])
    print(f"ours / trl: steps/s x{ratio:.2f}, peak memory x{runs['ours'][1] / runs['trl'][1]:.2f}")


if __name__ == "__main__":
    main()
