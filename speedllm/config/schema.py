"""Typed schema of every config group, registered in Hydra's ConfigStore.

Hydra merges each `conf/<group>/<option>.yaml` into these dataclasses, so an unknown key or a
value of the wrong type is rejected before anything runs. Cross-field rules live in validate.py.
"""

from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING, OmegaConf

from speedllm.hardware import HardwareConfig
from speedllm.models.config import PROJECTIONS, ModelConfig


@dataclass
class ParallelConfig:
    """Parallel layout. world = dp * cp * tp * pp; dp=-1 infers dp from the world size."""

    name: str = "single"
    dp: int = -1
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline stages per pp rank (interleaved schedules)
    ep: int = 1  # expert parallel, carved out of dp * cp
    cp: int = 1
    cp_mode: str = "allgather"  # allgather | ring | ulysses | hybrid (speedllm/parallel/context.py)
    # hybrid: ranks per ulysses group, e.g. the devices of a node (0: the largest divisor of cp below cp that
    # divides the attention heads per tp rank)
    cp_ulysses: int = 0
    fsdp: bool = True  # shard params/grads/optimizer over dp (FSDP2); False replicates (DDP-like)
    reshard_after_forward: bool = True  # ZeRO-3-like; False keeps gathered params (ZeRO-2-like)
    sequence_parallel: bool = True  # with tp > 1
    # GPipe | 1F1B | Interleaved1F1B | InterleavedZeroBubble | ZBVZeroBubble | DualPipeV (the last two: vpp=2)
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 0  # 0: one per pipeline stage
    # none | optimizer (optimizer states in host memory between steps) | params (FSDP2's CPUOffloadPolicy:
    # sharded parameters, gradients and optimizer states in host memory, the update on the host); docs/offload.md
    offload: str = "none"
    pp_layers: Optional[List[int]] = None  # explicit layers per stage; None splits evenly


@dataclass
class QuantConfig:
    """quant=: weight quantization for inference, low-precision or quantization-aware training (speedllm.quant)."""

    name: str = "none"  # none | int8_wo | int4_wo | int8_dyn | float8 | qat_int4
    group_size: int = 128  # int4_wo / qat_int4: input features sharing one scale and zero
    recipe: str = "tensorwise"  # float8: tensorwise | rowwise
    fsdp_float8_all_gather: bool = True  # float8 tensorwise: FSDP2 all-gathers weights in float8


@dataclass
class TaskConfig:
    """What the run does: conf/task/<name>.yaml names the callable `_target_(cfg, rt)` that runs it."""

    name: str = "pretrain"  # pretrain | sft | dpo | grpo | distill | generate | chat | serve | evaluate | preprocess | convert | plan | dryrun | doctor
    _target_: str = "speedllm.tasks.pretrain.run"
    # planning or converting between machines: one process, no devices (the world size is not launched)
    in_process: bool = False
    # runs a trained model (tensor + data parallel layouts only; training-only rules do not apply)
    inference: bool = False


@dataclass
class DataConfig:
    name: str = "demo"
    # pretraining: one prefix, or a Megatron-style weighted list [w1, prefix1, w2, prefix2]
    path: Any = None
    tokenizer: str = "${model.tokenizer}"
    split: Any = "969,30,1"  # train,valid,test weights (Megatron style); on the command line: data.split=[98,1,1]
    # preprocess
    input: Any = None  # file, glob or list of them
    output_prefix: Optional[str] = None
    text_key: List[str] = field(default_factory=lambda: ["text"])
    append_eod: bool = True
    workers: int = 1
    on_error: str = "fail"  # fail | skip
    cache_dir: str = "${cache_home:}"  # SPEEDLLM_CACHE, else ~/.cache/speedllm
    # sft
    format: str = "pretrain"  # pretrain | alpaca | sharegpt | messages
    loss_on: str = "assistant"  # all | assistant | last
    overlong: str = "truncate"  # truncate | drop
    packing: bool = True
    trust_remote_code: bool = False
    loader_workers: int = 0


@dataclass
class TrainConfig:
    # defaults: the `python launch.py` demo, about two minutes of qwen3_tiny on 2 idle CPU cores
    steps: int = 400
    seq_len: int = 128
    micro_batch_size: int = 4
    global_batch_size: int = 8
    log_every: int = 10
    eval_every: int = 100
    eval_steps: int = 5
    grad_clip: float = 1.0
    recompute: str = "none"  # none | selective | full
    # saved activations of the decoder layers go to host memory in forward and come back for backward
    # (speedllm.parallel.offload; docs/offload.md)
    activation_offload: bool = False
    compile: bool = False
    max_bad_steps: int = 5  # consecutive non-finite steps before the run stops
    stop_after: int = 0  # stop (with a checkpoint) after this many steps in this process; 0: run to train.steps
    # tokens per chunk of the output projection + cross-entropy; 0: one chunk if the fp32 logits fit 128 MiB,
    # else chunks that fit it (speedllm.ops.loss.chunk_rows)
    loss_chunk_size: int = 0


@dataclass
class OptimConfig:
    """An optimizer group (conf/optim/<name>.yaml): `_target_` is a torch optimizer class, instantiated with
    `_partial_: true` over the parameter groups the code builds; the fields of a subclass below are its
    keyword arguments. lr, weight_decay and the schedule fields are common to every optimizer."""

    name: str = MISSING
    _target_: str = MISSING
    _partial_: bool = True
    lr: float = 3e-3  # peak; the schedule scales it per step
    weight_decay: float = 0.1  # on matrices; never on norms, on embeddings only with decay_embeddings
    # learning-rate schedule (speedllm.train.schedule), not keyword arguments of the optimizer
    min_lr: float = 3e-4
    schedule: str = "cosine"  # constant | linear | cosine | wsd
    warmup_steps: int = 10
    decay_fraction: float = 0.2  # wsd: share of steps spent decaying
    decay_embeddings: bool = False


@dataclass
class AdamWConfig(OptimConfig):
    name: str = "adamw"
    _target_: str = "torch.optim.AdamW"
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    # null: fused on cpu/cuda (one pass per tensor, speedllm.train.optimizer.fused_adamw), else foreach, the
    # multi-tensor path; both work with DTensor parameters (FSDP2 / TP)
    fused: Optional[bool] = None
    foreach: Optional[bool] = None


@dataclass
class SGDConfig(OptimConfig):
    name: str = "sgd"
    _target_: str = "torch.optim.SGD"
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    foreach: bool = True


@dataclass
class AdafactorConfig(OptimConfig):
    name: str = "adafactor"
    _target_: str = "torch.optim.Adafactor"
    beta2_decay: float = -0.8
    eps: List[Optional[float]] = field(default_factory=lambda: [None, 1e-3])
    d: float = 1.0
    foreach: bool = True


@dataclass
class MuonConfig(OptimConfig):
    """optim=muon (speedllm.train.muon): torch.optim.Muon's update on the hidden matrices with `lr` and
    `weight_decay`, AdamW on embeddings, output, router, norms and biases with the `adamw_*` keys. The schedule
    scales both peaks by the same factor (min_lr is the Muon group's floor; AdamW's is adamw_lr * min_lr / lr)."""

    name: str = "muon"
    _target_: str = "speedllm.train.muon.MuonAdamW"
    lr: float = 0.02
    min_lr: float = 0.002
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: List[float] = field(default_factory=lambda: [3.4445, -4.7750, 2.0315])
    ns_steps: int = 5
    eps: float = 1e-7
    adjust_lr_fn: Optional[str] = None  # null | original: sqrt(max(1, out/in)); match_rms_adamw: 0.2*sqrt(max(out, in))
    # null: bfloat16 (torch's) on accelerators, float32 on CPUs (bf16 matmuls ~50x slower there)
    ns_dtype: Optional[str] = None
    adamw_lr: float = 3e-3
    adamw_betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.1
    fused: Optional[bool] = None  # the AdamW group's kernel, as optim=adamw's
    foreach: Optional[bool] = None


# optimizer schemas by name (each has a file conf/optim/<name>.yaml)
OPTIMIZERS = {c.name: c for c in (AdamWConfig, SGDConfig, AdafactorConfig, MuonConfig)}


@dataclass
class CheckpointConfig:
    dir: str = "${run_dir}/checkpoints"
    every: int = 0  # 0: only at the end
    keep: int = 3
    save_final: bool = True
    async_save: bool = False  # stage to host memory, write in the background (training goes on meanwhile)
    load: Optional[str] = None  # <dir> | auto
    load_hf: Optional[str] = None  # HF model directory


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    progress_bar: bool = True


@dataclass
class LauncherConfig:
    nproc_per_node: int = 0  # 0: derived from the parallel layout
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = "localhost:0"  # host:port; port 0 picks a free one (single node)
    rdzv_backend: str = "c10d"
    max_restarts: int = 0
    monitor_interval: float = 0.5
    rdzv_timeout: float = 30.0  # seconds to wait for the other nodes to join (and for the endpoint to answer)


@dataclass
class GenerateConfig:
    prompt: Optional[str] = None
    prompts_file: Optional[str] = None
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop: List[str] = field(default_factory=list)
    batch_size: int = 8
    stream: bool = True
    output: Optional[str] = None
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template
    enable_thinking: bool = False
    num_samples: int = 3  # samples printed at the end of a training run


@dataclass
class EvaluateConfig:
    # perplexity over a split of data= (when tasks is empty)
    split: str = "valid"
    steps: int = 20
    # lm-eval task suites (the .[eval] extra): names, local task YAMLs, few-shot examples, samples per task
    tasks: List[str] = field(default_factory=list)
    include_path: Optional[str] = None
    num_fewshot: Optional[int] = None
    limit: Optional[float] = None  # samples per task (a fraction when < 1)
    batch_size: int = 8


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8  # requests decoded together (rows of the slot KV cache)
    max_queue: int = 64  # requests waiting for a row; beyond it the server answers 503
    max_len: int = 4096  # tokens per request, prompt + completion (capped at model.max_position_embeddings)
    api_key: Optional[str] = None  # when set, clients must send "Authorization: Bearer <key>"
    model_name: Optional[str] = None  # the served model's id; default: the HF directory's name or model.name
    max_body_bytes: int = 1048576  # a request body past it gets a 413 (1 MiB holds a 40k-token prompt as JSON)
    read_timeout: float = 30.0  # seconds a client has to send a whole request; a slower one's connection is closed


@dataclass
class ConvertConfig:
    to: str = "hf"  # hf | dcp | peft
    merge_lora: bool = False  # convert.to=hf of a LoRA checkpoint: base + adapters merged
    out: Optional[str] = None
    max_shard_size: str = "5GB"
    dtype: Optional[str] = None  # None keeps the checkpoint's dtype


@dataclass
class FinetuneConfig:
    """What trains: every weight (full), or LoRA adapters on a frozen base (lora), held in 4-bit (qlora)."""

    name: str = "full"  # full | lora | qlora
    rank: int = 8
    alpha: float = 16.0  # adapters are scaled by alpha / rank, as in PEFT
    dropout: float = 0.0
    # module names (the last part of the name, as PEFT's target_modules) to adapt
    targets: List[str] = field(default_factory=lambda: list(PROJECTIONS))
    adapter: Optional[str] = None  # a PEFT adapter directory to start from


@dataclass
class DpoConfig:
    beta: float = 0.1


@dataclass
class RLConfig:
    """task=grpo: reinforcement learning with verifiable rewards (docs/tasks/grpo.md says which settings are which
    paper's method)."""

    group_size: int = 8  # completions sampled per prompt (the group its advantages are relative to)
    prompts_per_step: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    ppo_epochs: int = 1  # passes over each step's rollouts
    mini_batches: int = 1  # optimizer steps per pass (the rollouts split into this many)
    kl_coef: float = 0.0  # KL to the reference model (k3); 0: no reference model is built
    clip_low: float = 0.2
    clip_high: float = 0.2  # DAPO's clip-higher: 0.28
    advantage_std_norm: bool = True  # divide by the group's reward std (GRPO); false: Dr. GRPO
    loss_agg: str = "seq_mean"  # seq_mean (GRPO) | token_mean (DAPO) | constant (Dr. GRPO: / rows x max_new_tokens)
    importance: str = "token"  # token | sequence (GSPO)
    dynamic_sampling: bool = False  # DAPO: groups whose rewards are all equal are replaced by fresh prompts
    max_resample: int = 4  # dynamic sampling: extra rollouts per step at most before it trains on what it has
    overlong_buffer: int = 0  # DAPO's overlong penalty over the last this-many tokens before max_new_tokens; 0: off
    overlong_penalty: float = 1.0  # the penalty at max_new_tokens (linear from 0 over the buffer)
    router_replay: Optional[bool] = None  # MoE: train with the rollout's experts; None: on for MoE models
    # the PPO ratio's old policy: rollout (the sampler's log-probs) | recompute (a training forward before the update)
    old_logprobs: str = "rollout"
    # none | tis | mis: verl's rollout correction of the rollout -> training mismatch (needs old_logprobs=recompute)
    rollout_correction: str = "none"
    rollout_correction_threshold: float = 2.0  # C: tis truncates the ratio at C; mis drops tokens outside [1/C, C]
    rewards: List[Any] = field(default_factory=list)  # [{_target_: module.fn, weight: 1.0}, ...], TRL's signature
    num_samples: int = 2  # completions printed (with their rewards) every train.log_every
    # multi-turn tool use: [{_target_: module.fn}, ...], each a callable of a call's JSON arguments returning text
    # (speedllm.train.tools.calculator is built in); [] = single-turn completions
    tools: List[Any] = field(default_factory=list)
    max_turns: int = 4  # tool calls per completion; a `</tool_call>` after that ends it
    tool_timeout_s: float = 10.0  # a tool that has not answered by then answers an error (rl/tool_errors)
    tool_max_chars: int = 2000  # a tool's answer is cut to this many characters


@dataclass
class DistillConfig:
    """task=distill (speedllm.tasks.distill): the frozen teacher and the divergence the student learns from."""

    teacher: Optional[str] = None  # a Hugging Face model directory or a checkpoint (dir) of one of our runs
    loss: str = "forward_kl"  # forward_kl | reverse_kl | jsd (GKD's generalized JSD with beta)
    beta: float = 0.5  # jsd: 0 = forward KL, 1 = reverse KL
    temperature: float = 1.0  # both distributions are softmax(logits / temperature)
    ce_weight: float = 0.0  # loss = (1 - ce_weight) divergence + ce_weight cross-entropy on the labels
    top_k: Optional[int] = None  # keep the teacher's top_k tokens, renormalized; None: the whole distribution
    on_policy: float = 0.0  # probability a step trains on the student's own samples (GKD's lambda), same loss
    # same: the teacher sharded like the student (FSDP2, TP) | replicate: whole on every rank, no gathers of it
    # (a student without TP)
    teacher_parallel: str = "same"
    # none | int8_wo: the teacher's decoder projections in int8 with one scale per output row (speedllm.quant), its
    # embedding, norms, output projection and MoE experts in full precision; a teacher whole on every rank only
    teacher_quant: str = "none"


@dataclass
class PlanConfig:
    top: int = 10  # rows of the ranked table
    show_rejected: int = 10
    compute_efficiency: float = 0.6  # fraction of peak FLOP/s large matmuls reach (planner's time model)
    memory_margin: float = 0.1  # fraction of device memory the planner leaves for runtime and fragmentation
    # let the search offload to host memory (parallel.offload, train.activation_offload) when nothing fits without
    allow_offload: bool = True
    # the task task=plan (and task=dryrun's parallel=auto) plans for: its layout rules, memory and step
    task: str = "pretrain"


@dataclass
class DryrunConfig:
    ranks: Optional[List[int]] = None  # simulated ranks of task=dryrun; None: first/last stage, two expert groups


@dataclass
class RunConfig:
    model: ModelConfig = MISSING
    parallel: ParallelConfig = MISSING
    hardware: HardwareConfig = MISSING
    task: TaskConfig = MISSING
    quant: QuantConfig = field(default_factory=QuantConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = MISSING
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    dryrun: DryrunConfig = field(default_factory=DryrunConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    seed: int = 1234
    run_dir: str = "${hydra:runtime.output_dir}"


def typed(cfg) -> RunConfig:
    """The run as typed objects (the schema's dataclasses), from a composed or a frozen (loaded) config.

    Workers and tasks read these; nothing edits them. A frozen config.yaml has lost its types, so its optim
    section is typed again by its schema's name.
    """
    if isinstance(cfg, RunConfig):
        return cfg
    if OmegaConf.get_type(cfg) is not RunConfig:
        schema = OmegaConf.structured(RunConfig)
        schema.optim = OmegaConf.structured(OPTIMIZERS[cfg.optim.name])
        cfg = OmegaConf.merge(schema, cfg)
    return OmegaConf.to_object(cfg)
