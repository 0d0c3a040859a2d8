"""Cross-field checks on a composed config, run before any process starts.

Each rule raises UserError with ONE line naming the key(s), their values and a fix. Hydra's schema has already
rejected unknown keys and wrong types; what is left are rules that span several keys or touch the machine.
"""

from omegaconf import DictConfig

# the rules live by concern; their public names stay importable from here
from speedllm.config.devices import check_device, check_rendezvous
from speedllm.config.inputs import check_extras, check_hf_model, check_inputs, check_paths
from speedllm.config.layout import (
    check_batch,
    check_dryrun,
    check_finetune,
    check_parallel,
    check_qlora,
    check_quant,
    check_task,
    check_world,
    validate_layout,
)
from speedllm.config.locations import check_outputs
from speedllm.config.values import (
    CHOICES,
    LORA_TARGETS,
    VALUE_RULES,
    WHOLE_LISTS,
    check_choices,
    check_dtype,
    check_inference,
    check_known_keys,
    check_model,
    check_task_name,
    check_values,
    hybrid_model_errors,
)
from speedllm.native import isa
from speedllm.tasks import task_spec

__all__ = [
    "CHOICES", "LORA_TARGETS", "VALUE_RULES", "WHOLE_LISTS", "check_batch", "check_choices", "check_device",
    "check_dryrun", "check_dtype", "check_extras", "check_finetune", "check_hf_model",
    "check_inference", "check_inputs", "check_known_keys", "check_model", "check_outputs", "check_parallel",
    "check_paths", "check_qlora", "check_quant", "check_rendezvous", "check_task", "check_task_name",
    "check_values", "check_world", "hybrid_model_errors", "validate", "validate_layout", "validate_values",
]


def validate_values(cfg: DictConfig) -> None:
    """The rules that need no layout: run before the launcher derives the world size from these values."""
    check_known_keys(cfg)
    check_task_name(cfg)
    check_hf_model(cfg)
    check_choices(cfg)
    check_values(cfg)
    check_dtype(cfg)
    check_model(cfg)
    if cfg.task.inference:
        check_inference(cfg)


def validate(cfg: DictConfig, world_size: int, nproc_per_node: int) -> None:
    """Run every rule; the first failure raises UserError."""
    validate_values(cfg)
    check_extras(cfg)
    validate_layout(cfg, world_size)
    task_spec(cfg.task.name).inputs(cfg)  # what the task reads (GRPO's prompts and rewards, distill's teacher)
    if cfg.task.name != "plan":
        isa()  # SPEEDLLM_CPU_ISA, where set, names a kernel path this CPU runs
        check_world(cfg, world_size)
        check_paths(cfg)
        check_outputs(cfg)
        if not cfg.task.in_process:
            check_rendezvous(cfg)
            check_device(cfg, nproc_per_node)
        if cfg.task.name == "dryrun":
            check_dryrun(cfg, world_size)
        if cfg.task.name not in ("doctor", "convert", "preprocess"):  # preprocess uses no model
            from speedllm.data.loader import check_vocab

            check_vocab(cfg)
    if cfg.task.inference:
        check_inputs(cfg)
