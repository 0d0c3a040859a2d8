"""Peak memory of a `task=grpo` step against the planner's estimate (task=plan plan.task=grpo), over rollout sizes.

    python -m benchmarks grpo_memory [--sizes 8x8x32 16x8x64 32x8x64] [--dry]

The demo model (qwen3_tiny: 4 layers x 256, the demo tokenizer's 8,192-token vocabulary) in float32 on this CPU,
`data=rl_demo`, one GRPO step (rollout, rewards, one update; no KL: no reference model) for each rollout size
PROMPTSxGROUPxNEW_TOKENS, each in its own process. The measured growth is the step's peak resident set size
(/proc's VmHWM, reset through /proc/self/clear_refs once the imports, the tokenizer and the prompts are loaded)
less the resident size at that reset: what building the model and optimizer, the rollout and the update add. The
estimate is the planner's peak for the same run on one device (Planner.estimate: parameters, gradients, AdamW
states, activations, the rollout's KV cache, the update's full-vocabulary logits). Prints one row per size.
--dry: two small sizes.
"""

import json
import subprocess
import sys

from benchmarks.common import MiB, make_parser, parse

CHILD = "import sys; from benchmarks.bench_grpo_memory import measure; measure(sys.argv[1:])"


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(key + ":"))


def measure(overrides) -> None:
    """In a fresh process: one GRPO step under `overrides`; prints {measured, estimated, parts} as JSON."""
    import gc
    import tempfile
    from dataclasses import replace

    from omegaconf import OmegaConf

    from speedllm.config import compose_config
    from speedllm.planner.layout import layout_from_config
    from speedllm.planner.search import Planner, problem_from_config
    from speedllm.runtime import Runtime
    from speedllm.tasks import task_spec
    from speedllm.tasks.grpo import read_prompts, run

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = compose_config("task=grpo", "hardware=cpu", "hardware.dtype=float32", "train.steps=1",
                             "checkpoint.save_final=false", "logging.progress_bar=false", "rl.kl_coef=0",
                             f"run_dir={run_dir}", *overrides)
        OmegaConf.resolve(cfg)
        read_prompts(cfg)  # the tokenizer's and the prompts' first load: not the step's
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        start = _status("VmRSS")
        run(cfg, Runtime())
        measured = _status("VmHWM") - start
        # after the step: the planner allocates nothing the step could reuse
        spec = task_spec("grpo")
        planner = Planner(problem_from_config(cfg, 1, spec))
        layout = replace(layout_from_config(cfg.parallel, cfg.train), micro_batch=spec.micro_batch(cfg, 1))
        estimate = planner.rank_memories(layout)[0]
    parts = {k: getattr(estimate, k) for k in ("activations", "rollout", "logits")}
    print(json.dumps({"measured": measured, "estimated": estimate.total, "parts": parts}))


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--sizes", nargs="+", default=["8x8x32", "16x8x64", "32x8x64"],
                        help="rollout sizes, prompts x group x new tokens")
    args = parse(parser, argv, sizes=["2x4x8", "4x4x16"])
    print("| prompts x group | new tokens | measured MiB | planner MiB | planner / measured | rollout cache MiB | "
          "logits MiB | activations MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        prompts, group, new = map(int, size.split("x"))
        overrides = [f"rl.prompts_per_step={prompts}", f"rl.group_size={group}", f"rl.max_new_tokens={new}"]
        out = subprocess.run([sys.executable, "-c", CHILD, *overrides], check=True, capture_output=True, text=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        p = r["parts"]
        print(f"| {prompts} x {group} | {new} | {r['measured'] / MiB:,.0f} | {r['estimated'] / MiB:,.0f} | "
              f"{r['estimated'] / r['measured']:.2f} | {p['rollout'] / MiB:,.1f} | {p['logits'] / MiB:,.1f} | "
              f"{p['activations'] / MiB:,.1f} |", flush=True)


if __name__ == "__main__":
    main()
