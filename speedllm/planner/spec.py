"""What a task declares once, beside its `run` (DESIGN.md, "A task declares itself once"): the layouts it refuses,
its value rules, the optional packages it needs, what it reads, the memory it adds to a training rank and the work
of its step. Each task module holds its `SPEC`; validation (speedllm.config), task=plan, parallel=auto (the search
here) and task=dryrun read these and never switch on task names. A module without a SPEC is costed and checked as
pretraining (TRAINING).

The functions take `run`, the run config (a DictConfig in validation, its sections as dataclasses in the planner:
attribute access alike), and a planner Layout (validation builds one from the config: layout_from_config).
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

from speedllm.errors import UserError
from speedllm.parallel.rules import inference_layout_errors
from speedllm.planner.layout import Layout
from speedllm.planner.training import StageParams


def at_least(low):
    """A value rule (test, what it must be): at least `low`."""
    return (lambda v: v >= low), f">= {low}"


def above(low):
    return (lambda v: v > low), f"> {low}"


def fraction(v) -> bool:
    return 0 <= v <= 1


class Rank(NamedTuple):
    """What the planner knows of a layout's busiest rank, for a task's memory and time declarations."""

    layout: Layout
    params: StageParams  # its parameter elements (held, gathered)
    seq_len: int  # tokens per sequence of the step's workload
    hardware: object  # HardwareConfig fields
    efficiency: float  # plan.compute_efficiency


def no_errors(run, layout: Layout, frozen=None) -> List[str]:
    return []


def no_extras(run) -> Iterable[Tuple[str, str, str]]:
    return ()


def nothing_read(run) -> None:
    return None


def no_memory(run, frozen, rank: Rank) -> Dict[str, float]:
    return {}


def train_workload(run) -> Tuple[int, int]:
    """A step of the training loop: train.global_batch_size sequences of train.seq_len tokens."""
    return run.train.seq_len, run.train.global_batch_size


@dataclass(frozen=True)
class TaskSpec:
    """One task's declarations (every field has pretraining's default: nothing beyond the training rules)."""

    # (run, layout, frozen) -> what keeps the task from running under the layout, one line each
    # (speedllm.parallel.rules' form), beyond the rules of every layout (model, offload, optimizer, QLoRA) and of
    # training batches; frozen: frozen_model(run)
    layout_errors: Callable[..., List[str]] = no_errors
    # the task's own keys: key -> (test, what it must be), speedllm.config.values.VALUE_RULES' form
    values: Dict[str, Tuple[Callable, str]] = field(default_factory=dict)
    # run -> (what needs it, module, extra) for each optional package the run imports
    extras: Callable[..., Iterable[Tuple[str, str, str]]] = no_extras
    # run -> None: what the task reads before any rank starts (files, functions); raises UserError
    inputs: Callable[..., None] = nothing_read
    # the step trains on train.global_batch_size x train.seq_len batches cut in train.micro_batch_size (the
    # train.* batch rules apply); False: the task makes its own batches (workload, micro_batch)
    train_batches: bool = True
    # run -> (tokens per sequence, sequences per step) of the step's forward and backward
    workload: Callable[..., Tuple[int, int]] = train_workload
    # (run, dp) -> the micro-batch a data-parallel rank trains on, where the task fixes it (None: searched)
    micro_batch: Optional[Callable[..., int]] = None
    # rows of the model's forward per batch item (train.*_batch_size count items): a DPO pair is two replies
    rows_per_item: int = 1
    # (run, frozen, Rank) -> bytes a training rank holds beyond training's own, by speedllm.planner.memory.Memory
    # field: teacher (a frozen model), rollout (a sampling cache), logits
    memory: Callable[..., Dict[str, float]] = no_memory
    # run -> the frozen model (ModelConfig fields) the task holds beside the trained one, or None
    frozen_model: Callable[..., object] = lambda run: None
    # (run, frozen, Rank) -> seconds a step spends beyond its forward, backward and update (a teacher's forward,
    # a rollout's decode)
    extra_seconds: Callable[..., float] = lambda run, frozen, rank: 0.0
    # the keys that size the workload, for "no layout fits: lower ..."
    workload_keys: str = "train.seq_len, train.global_batch_size"
    # runs a trained model (as its conf/task file's task.inference says): placed for inference
    # (Planner.inference_layout), not searched as training
    inference: bool = False
    # run -> the task this one plans for (task=plan, task=dryrun: plan.task), whose declarations planning reads
    plans: Optional[Callable[..., str]] = None
    # run -> whether it scores its own samples to train on them (a rollout's log-probabilities against the
    # training forward's): hardware.batch_invariant unset, batch-invariant mode on for it on a CPU in bfloat16,
    # where torch's kernels differ by up to 6e-2 and the mode's are not slower (docs/benchmarks/rl.md)
    batch_invariant: Callable[..., bool] = lambda run: False


def refuse_pairs(run) -> None:
    """The training loop's tasks read sequences; preference pairs are task=dpo's."""
    if run.data.format == "pairs":
        raise UserError(f"data.format=pairs holds preference pairs for task=dpo, not task={run.task.name}; use "
                        "task=dpo")


TRAINING = TaskSpec()
# pretraining and SFT (speedllm.tasks.pretrain): the training rules, sequences not pairs
TRAIN_LOOP = TaskSpec(inputs=refuse_pairs)


def inference_errors(run, layout: Layout, frozen=None) -> List[str]:
    """A trained model runs under tensor and data parallelism, without the training levers."""
    errors = inference_layout_errors(run.task.name, pp=layout.pp, cp=layout.cp, ep=layout.ep)
    if layout.offload != "none" or layout.activation_offload:
        errors.append(f"task={run.task.name} runs a trained model: parallel.offload={layout.offload} and "
                      f"train.activation_offload={layout.activation_offload} are training levers; leave them at "
                      "none / false")
    return errors


def generate_workload(run) -> Tuple[int, int]:
    """Generation: generate.batch_size sequences of train.seq_len prompt tokens plus generate.max_new_tokens, whose
    KV cache and last logits a rank holds."""
    return run.train.seq_len + run.generate.max_new_tokens, run.generate.batch_size


# generate, chat, evaluate (and, with its own workload, serve): inference layouts (Planner.inference_layout)
INFERENCE = TaskSpec(layout_errors=inference_errors, train_batches=False, workload=generate_workload,
                     workload_keys="generate.batch_size, generate.max_new_tokens", inference=True)
# task=plan and task=dryrun: cost and build the layouts of plan.task; neither runs a step's batch
PLANNING = TaskSpec(train_batches=False, plans=lambda run: run.plan.task)
