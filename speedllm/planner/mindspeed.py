"""MindSpeed-LLM's published Qwen3 pretraining setups (shared/reference/qwen3.md), the planner's yardstick."""

from speedllm.planner.layout import Layout

# model, NPUs, hardware profile, degrees, micro / global batch, the recompute they state (None: not stated).
# Sequence length 4096.
PUBLISHED = [
    ("qwen3_0.6b", 8, "npu_a2", dict(tp=1, pp=1), 1, 32, None),
    ("qwen3_1.7b", 8, "npu_a2", dict(tp=1, pp=1), 1, 32, None),
    ("qwen3_4b", 8, "npu_a2", dict(tp=1, pp=1), 1, 64, None),
    ("qwen3_8b", 8, "npu_a2", dict(tp=1, pp=2), 1, 64, None),
    ("qwen3_8b", 16, "npu_a3", dict(tp=2, pp=1), 1, 64, None),
    ("qwen3_14b", 8, "npu_a2", dict(tp=8, pp=1), 4, 128, None),
    ("qwen3_32b", 16, "npu_a2", dict(tp=8, pp=2, vpp=8), 2, 256, None),
    ("qwen3_30b_a3b", 16, "npu_a2", dict(tp=1, pp=2, ep=8), 1, 256, "full"),
    ("qwen3_235b_a22b", 256, "npu_a2", dict(tp=1, pp=4, vpp=8, ep=32), 1, 1024, "full"),  # "block recompute"
]


def published_layout(world: int, degrees: dict, micro: int, recompute: str = "none") -> Layout:
    dp = world // (degrees.get("tp", 1) * degrees.get("pp", 1))
    schedule = "Interleaved1F1B" if degrees.get("vpp", 1) > 1 else "1F1B"
    return Layout(dp=dp, micro_batch=micro, recompute=recompute, schedule=schedule, **degrees)


def published_estimate(planner, world: int, degrees: dict, micro: int, recompute):
    """A published layout costed by the planner, with its stated recompute or else the least that fits."""
    for policy in [recompute] if recompute else ["none", "selective", "full"]:
        est = planner.estimate(published_layout(world, degrees, micro, policy))
        if est.fits:
            break
    return est
