"""The planner's tables for BENCHMARKS.md: MindSpeed-LLM's published Qwen3 layouts against the planner's own
choice, their MoE layouts built rank by rank (task=dryrun) beside the planner's bytes, and predicted against
measured memory of the tiny models on this CPU.

    python -m benchmarks planner            # all tables (the measured one spawns 2-rank CPU runs)
    python -m benchmarks planner --no-measure
    python -m benchmarks planner --dry      # the first row of each table
"""

import time

from benchmarks.common import make_parser, measured_step, parse
from speedllm.config import compose_config
from speedllm.config.schema import typed
from speedllm.hardware import load_profile
from speedllm.planner.layout import layout_from_config
from speedllm.planner.memory import GIB, rank_params
from speedllm.planner.mindspeed import PUBLISHED, published_estimate
from speedllm.planner.search import Planner, Problem, problem_from_config
from speedllm.tasks.dryrun import build_rank, sample_ranks

MEASURED = [("qwen3_tiny", "single", 1), ("qwen3_tiny", "fsdp2", 2), ("qwen3_moe_tiny", "fsdp2", 2),
            ("qwen3_tiny", "tp2", 2), ("qwen3_tiny", "pp2", 2)]
COMMON = ["hardware=cpu", "train.seq_len=128", "train.micro_batch_size=2", "train.global_batch_size=4",
          "train.loss_chunk_size=256"]


def mindspeed_table(rows: int = None) -> None:
    print("| model | devices | MindSpeed layout (recompute) | GiB/dev | est. tokens/s | planner's choice | GiB/dev | "
          "est. tokens/s | search s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, world, hw_name, degrees, micro, global_batch, recompute in PUBLISHED[:rows]:
        start = time.perf_counter()
        planner = Planner(Problem(compose_config(f"model={name}").model, load_profile(hw_name), world, 4096, global_batch))
        theirs = published_estimate(planner, world, degrees, micro, recompute)
        best = planner.search().best
        seconds = time.perf_counter() - start  # meta model build + search
        print(f"| {name} | {world} x {hw_name} | {theirs.layout.short()} | {theirs.memory.total / GIB:.1f}"
              f"{'' if theirs.fits else ' (too big)'} | {theirs.tokens_per_s:,.0f} | {best.layout.short()} | "
              f"{best.memory.total / GIB:.1f} | {best.tokens_per_s:,.0f} | {seconds:.1f} |")


# model, parallel option, ranks, overrides: MindSpeed's MoE layouts and the planner's 235B choice on 256 NPUs
BUILT = [("qwen3_30b_a3b", "pp2_ep8", 16, []),
         ("qwen3_235b_a22b", "pp4_ep32", 256, []),
         # MindSpeed's published one: vpp 8 (they pad 94 layers to 96; here 94 split over 32 stages)
         ("qwen3_235b_a22b", "pp4_ep32", 256, ["parallel.vpp=8", "parallel.pp_schedule=Interleaved1F1B",
                                               "parallel.pp_layers=[2,3,3,3,3,3,3,3,3,3,3,3,3,3,3,3,3,3,3,3,3,3,3,"
                                               "3,3,3,3,3,3,3,3,2]"]),
         ("qwen3_235b_a22b", "ep2", 256, ["parallel.ep=8"])]


def dryrun_table(rows: int = None) -> None:
    print("| model | layout | ranks | built ranks (task=dryrun) | params GiB | grads GiB | optimizer GiB | "
          "= planner's bytes | build s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, parallel, world, overrides in BUILT[:rows]:
        cfg = compose_config("task=dryrun", "hardware=npu_a2", f"model={model}", f"parallel={parallel}", *overrides)
        cfg.parallel.dp = world // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
        cfg.launcher.nproc_per_node, cfg.run_dir = world, "unused"
        cfg = typed(cfg)
        start = time.perf_counter()
        reports = [build_rank(cfg, rank, world) for rank in sample_ranks(cfg.parallel, world)]
        seconds = time.perf_counter() - start
        top = max(reports, key=lambda r: r.params)
        equal = sum((r.params, r.grads, r.optimizer) == r.planned for r in reports)
        layout = " ".join(layout_from_config(cfg.parallel, cfg.train).short().split()[:-2])  # without mb, recompute
        print(f"| {model} | {layout} | {world} | {', '.join(str(r.rank) for r in reports)} | "
              f"{top.params / GIB:.3f} | {top.grads / GIB:.3f} | {top.optimizer / GIB:.3f} | "
              f"{equal} of {len(reports)} ranks | {seconds:.1f} |")


def measured_table(rows: int = None) -> None:
    print("| model | layout | rank | params held (= predicted) | measured peak MiB | predicted MiB | ratio |")
    print("|---|---|---|---|---|---|---|")
    for model, parallel, world in MEASURED[:rows]:
        overrides = [f"model={model}", f"parallel={parallel}", *COMMON]
        cfg = compose_config(*overrides)
        cfg.parallel.dp = world // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
        records = measured_step(cfg, world)
        planner = Planner(problem_from_config(cfg, world))
        layout = layout_from_config(cfg.parallel, cfg.train)
        memories = planner.rank_memories(layout, cfg.parallel.pp_layers)
        split = planner.split(layout, cfg.parallel.pp_layers)
        for rec in records:
            mem = memories[rec["pp_rank"]]
            held = rank_params(planner.mt, layout, split, rec["pp_rank"]).sharded
            same = "yes" if rec["held"] == held else f"NO ({held})"
            print(f"| {model} | {parallel} | {rec['rank']} | {rec['held']:,} ({same}) | {rec['peak'] / 2**20:.1f} | "
                  f"{mem.total / 2**20:.1f} | {mem.total / rec['peak']:.3f} |")


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--no-measure", action="store_true", help="without the measured table")
    args = parse(parser, argv)
    rows = 1 if args.dry else None
    mindspeed_table(rows)
    print()
    dryrun_table(rows)
    if not args.no_measure:
        print()
        measured_table(rows)
