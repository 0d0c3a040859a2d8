"""The planner on random hybrid models (Qwen3.5 / Qwen3-Next style: random widths, layer patterns, dense or MoE,
Gated DeltaNet head counts): every layout it ranks passes validation, and each pipeline rank of the layouts it
ranks holds, as built by parallelize on the meta device (task=dryrun's build_rank), the planner's exact bytes."""

import random

import pytest
import torch.distributed as dist
from omegaconf import OmegaConf

from speedllm.config import compose_config
from speedllm.config.validate import check_world, validate_layout
from speedllm.planner.layout import apply_layout, uneven
from speedllm.planner.search import Planner, problem_from_config
from speedllm.tasks.dryrun import build_rank

pytestmark = pytest.mark.unit

WORLD = 4


def random_hybrid(rng: random.Random) -> list:
    """Model overrides of a random hybrid model (at least one layer of each kind)."""
    layers = rng.randint(2, 7)
    kinds = ["linear_attention", "full_attention"] + [rng.choice(["linear_attention", "full_attention"])
                                                      for _ in range(layers - 2)]
    rng.shuffle(kinds)
    heads = rng.choice([2, 4, 8])
    key_heads = rng.choice([1, 2, 4])
    overrides = [f"model.hidden_size={rng.choice([32, 48, 64, 96])}", f"model.num_hidden_layers={layers}",
                 "model.layer_types=[" + ",".join(kinds) + "]", f"model.num_attention_heads={heads}",
                 f"model.num_key_value_heads={rng.choice([h for h in (1, 2, 4) if heads % h == 0])}",
                 f"model.head_dim={rng.choice([8, 16])}", f"model.linear_num_key_heads={key_heads}",
                 f"model.linear_num_value_heads={key_heads * rng.choice([1, 2, 3])}",
                 f"model.linear_key_head_dim={rng.choice([8, 16])}",
                 f"model.linear_value_head_dim={rng.choice([8, 16, 24])}",
                 f"model.linear_conv_kernel_dim={rng.choice([2, 4])}",
                 f"model.linear_fused_projections={rng.choice([True, False])}",
                 f"model.tie_word_embeddings={rng.choice([True, False])}", "model.vocab_size=512",
                 "model.max_position_embeddings=16384"]
    if rng.random() < 0.5:
        return ["model=qwen3_5_tiny", *overrides, f"model.intermediate_size={rng.choice([40, 64, 96])}"]
    experts = rng.choice([2, 4, 6, 8])
    return ["model=qwen3_5_moe_tiny", *overrides, f"model.num_experts={experts}",
            f"model.num_experts_per_tok={rng.randint(1, 2)}", f"model.moe_intermediate_size={rng.choice([16, 24])}",
            f"model.shared_expert_intermediate_size={rng.choice([0, 32])}"]


def test_random_hybrid_models_plan_valid_layouts_whose_ranks_hold_the_planned_bytes():
    rng = random.Random(47)
    built = set()
    try:
        for _ in range(8):
            model = random_hybrid(rng)
            cfg = compose_config("task=pretrain", "run_dir=/unused", "hardware=h100", "hardware.dtype=float32",
                                 f"launcher.nproc_per_node={WORLD}", "train.seq_len=8192",
                                 "train.global_batch_size=8", *model)
            planner = Planner(problem_from_config(cfg, WORLD))
            ranked = planner.search().fitting
            assert ranked, model
            explicit = OmegaConf.to_object(cfg)
            for est in ranked:
                apply_layout(est.layout, explicit.parallel, explicit.train, uneven(planner.split(est.layout)))
                validate_layout(explicit, WORLD)
                check_world(explicit, WORLD)
            # each ranked placement once (micro batch and recompute do not move weights)
            layouts = {(e.layout.pp, e.layout.vpp, e.layout.ep, e.layout.cp, e.layout.fsdp): e.layout
                       for e in ranked}
            for layout in layouts.values():
                apply_layout(layout, explicit.parallel, explicit.train, uneven(planner.split(layout)))
                memories = planner.rank_memories(layout)
                for pp_rank in range(layout.pp):
                    r = build_rank(explicit, pp_rank * WORLD // layout.pp, WORLD)  # the first rank of its stage
                    mem = memories[pp_rank]
                    assert (r.params, r.grads, r.optimizer) == (mem.params, mem.grads, mem.optimizer), (model, layout)
                    built.add(layout.short().split(" mb")[0])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"built: {sorted(built)}")
    assert any(" pp2" in b or "pp4" in b for b in built) and any("ep" in b for b in built) \
        and any("cp" in b for b in built)


def test_gdn_context_parallel_chunks_shorter_than_the_conv_tail_are_refused():
    """cp2 cuts a sequence into 4 chunks: at 8 tokens each holds 2, fewer than the 3 conv inputs (kernel 4) a
    chunk hands to the next, which the packed-document masks cannot reach back across; 12 tokens run."""
    from speedllm.errors import UserError

    def check(seq_len, model="qwen3_5_tiny"):
        cfg = OmegaConf.to_object(compose_config("task=sft", "run_dir=/unused", f"model={model}", "parallel=cp2",
                                                 f"train.seq_len={seq_len}"))
        validate_layout(cfg, 2)

    with pytest.raises(UserError) as e:
        check(8)
    assert str(e.value) == ("train.seq_len=8 over parallel.cp=2 leaves Gated DeltaNet chunks of 2 tokens (2 x cp "
                            "per sequence), fewer than the 3 conv inputs a chunk carries to the next; raise "
                            "train.seq_len to 12 or more, or lower parallel.cp")
    check(12)
    check(8, "qwen3_tiny")  # attention alone carries nothing from chunk to chunk


@pytest.mark.parametrize("ops", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gdn_activation_bytes_are_what_autograd_saves(ops, dtype):
    """A Gated DeltaNet mixer's forward: the bytes of the tensors autograd saves for backward (distinct storages,
    neither the weights nor the input), per token, within 5% of the planner's term for that op set and dtype
    (two head shapes; the reference twin keeps the chunked rule's intermediates, the CPU kernel its chunk
    states)."""
    import torch

    from speedllm.hardware import DTYPES
    from speedllm.models.qwen3 import Qwen3
    from speedllm.ops.gated_delta_cpu import kernel
    from speedllm.planner.activations import gdn_activation_bytes, saved_bytes_per_element

    if ops == "cpu" and kernel() is None:
        pytest.skip("no C compiler here: the cpu op set runs the reference twin")
    torch_dtype = DTYPES[dtype]
    for heads in ([], ["model.linear_key_head_dim=16", "model.linear_value_head_dim=48",
                       "model.linear_num_value_heads=8"]):
        m = compose_config("model=qwen3_5_tiny", "model.num_hidden_layers=1", "model.layer_types=[linear_attention]",
                           *heads).model
        mixer = Qwen3(m, ops=ops).to(torch_dtype).layers["0"].linear_attn
        x = torch.randn(2, 128, m.hidden_size, dtype=torch_dtype, requires_grad=True)
        kept = {p.untyped_storage().data_ptr() for p in mixer.parameters()} | {x.untyped_storage().data_ptr()}
        saved, alive = {}, []

        def pack(t):  # holding each saved tensor: no storage freed mid-forward can be reused under another's address
            alive.append(t)
            storage = t.untyped_storage()
            if storage.data_ptr() not in kept:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mixer(x)
        e = torch_dtype.itemsize
        planned = gdn_activation_bytes(m, e, saved_bytes_per_element(ops, e)[0], ops)
        assert planned == pytest.approx(sum(saved.values()) / (2 * 128), rel=0.05), heads


@pytest.mark.parametrize("ops", ["reference", "cpu"])
def test_gdn_selective_recompute_keeps_the_planned_matmul_outputs(ops):
    """A Gated DeltaNet mixer under selective recompute (the policy parallelize applies): the bytes alive after its
    forward beyond its weights, input and output are the matmul outputs the planner counts (the projections and
    the rule's own for the op set) within 2%, for two head shapes."""
    from functools import partial

    import torch
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from speedllm.models.qwen3 import Qwen3
    from speedllm.ops.gated_delta_cpu import kernel
    from speedllm.parallel.parallelize import _selective_policy
    from speedllm.planner.activations import gdn_matmul_bytes
    from speedllm.planner.measure import PeakTensorMemory

    if ops == "cpu" and kernel() is None:
        pytest.skip("no C compiler here: the cpu op set runs the reference twin")
    for heads in ([], ["model.linear_key_head_dim=16", "model.linear_value_head_dim=48",
                       "model.linear_num_value_heads=8"]):
        m = compose_config("model=qwen3_5_tiny", "model.num_hidden_layers=1", "model.layer_types=[linear_attention]",
                           *heads).model
        mixer = Qwen3(m, ops=ops).layers["0"].linear_attn
        x = torch.randn(2, 128, m.hidden_size, requires_grad=True)
        with PeakTensorMemory(existing=[*mixer.parameters(), x]) as tracker:
            before = tracker.current
            out = checkpoint(mixer, x, use_reentrant=False,
                             context_fn=partial(create_selective_checkpoint_contexts, _selective_policy))
            kept = tracker.current - before - out.untyped_storage().nbytes()
        assert gdn_matmul_bytes(m, 4, ops) == pytest.approx(kept / (2 * 128), rel=0.02), heads
