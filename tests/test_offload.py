"""The levers for jobs that do not fit: parallel.offload, train.activation_offload and the DualPipeV schedule.

Through the launcher's steps on CPU/gloo (test_parallel's models, run settings and run_all: the 2-rank runs on one
set of ranks): 5 steps under fsdp2 with parallel.offload=params, with parallel.offload=optimizer and with
train.activation_offload=true (also under full recompute), and under pp2 with DualPipeV (dense, and the MoE model of
test_moe_parallel whose load-balancing statistics travel between stages), each equal the same layout without the
lever (the single process for DualPipeV) within 1e-5 relative (losses) and 1e-4 (parameters); resuming each from its
step-5 checkpoint gives its uninterrupted run's step-6 loss bit for bit. In-process: the hooks and the host-state
update give the plain run's numbers bit for bit, and FSDP2 is built with its CPU offload policy.

On CPU the device is the host, so no byte moves (docs/offload.md): what these runs check is that each lever's
code path composes with the layouts and leaves the numbers alone; the memory it saves is the planner's
(tests/test_planner.py) and the GPU benchmark's (benchmarks/gpu.py).
"""

import pytest
import torch
from test_moe_parallel import MOE
from test_parallel import DENSE, assert_matches, losses, run_all

from speedllm.config import compose_config

pytestmark = pytest.mark.distributed

DUALPIPEV = ["parallel=pp2_vpp2", "parallel.pp_schedule=DualPipeV"]
LEVERS = {  # name: (model, the reference layout, the lever)
    "offload_params": (DENSE, ["parallel=fsdp2"], ["parallel.offload=params"]),
    "offload_optimizer": (DENSE, ["parallel=fsdp2"], ["parallel.offload=optimizer"]),
    "activation_offload": (DENSE, ["parallel=fsdp2"], ["train.activation_offload=true"]),
    "activation_offload_full": (DENSE, ["parallel=fsdp2", "train.recompute=full"], ["train.activation_offload=true"]),
    "dualpipev": (DENSE, ["parallel=single"], DUALPIPEV),
    "dualpipev_moe": (MOE, ["parallel=single"], DUALPIPEV),
}
RESUMED = ("offload_params", "offload_optimizer", "activation_offload", "dualpipev", "dualpipev_moe")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launch_here, launch_ranks):
    """References (6 steps, checkpoint at 5), the levers (6 steps, checkpoint at 5), then each lever resumed."""
    root = tmp_path_factory.mktemp("levers")
    jobs = {}
    for name, (model, reference, lever) in LEVERS.items():
        ref = root / ("ref_" + "_".join(o.split("=")[-1] for o in [*model[:1], *reference]))
        jobs[ref] = [*model, *reference, "checkpoint.every=5"]
        jobs[root / name] = [*model, *reference, *lever, "checkpoint.every=5"]
    run_all(jobs, launch_here, launch_ranks)
    resumed = {}
    for name in RESUMED:
        model, reference, lever = LEVERS[name]
        checkpoint = root / name / "checkpoints" / "step_00000005"
        resumed[root / f"{name}_resumed"] = [*model, *reference, *lever, f"checkpoint.load={checkpoint}"]
    run_all(resumed, launch_here, launch_ranks)
    return root


def reference_dir(root, name):
    model, reference, _ = LEVERS[name]
    return root / ("ref_" + "_".join(o.split("=")[-1] for o in [*model[:1], *reference]))


@pytest.mark.parametrize("name", list(LEVERS))
def test_lever_matches_the_layout_without_it(name, runs):
    assert_matches(runs / name, reference_dir(runs, name), num_losses=6)


@pytest.mark.parametrize("name", RESUMED)
def test_lever_resumes_bit_exactly(name, runs):
    (resumed,) = losses(runs / f"{name}_resumed")  # step 6 only
    assert resumed == losses(runs / name)[5]


@pytest.mark.parametrize("name", ["dualpipev", "dualpipev_moe"])
def test_dualpipev_ran_torchs_schedule_on_stages_placed_in_a_v(name, runs):
    """The run's own line: ScheduleDualPipeV ran, pipeline rank r held stages r and 2*pp-1-r (a V), each stage one
    of the model's layers in order."""
    lines = [line for line in (runs / name / "launch.log").read_text().splitlines() if line.startswith("pipeline:")]
    assert lines == ["pipeline: ScheduleDualPipeV, 4 micro-batches, 4 stages; pp rank 0: stage 0 (layers 0), "
                     "stage 3 (layers 3); pp rank 1: stage 1 (layers 1), stage 2 (layers 2)"]


def tiny(tiny_model_cfg, seed=0, **overrides):
    from speedllm.models.qwen3 import Qwen3

    torch.manual_seed(seed)
    model = Qwen3(tiny_model_cfg(**overrides))
    model.init_weights(seed)
    return model


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_activation_offload_keeps_saved_tensors_on_the_host_and_gradients_exact(recompute, tiny_model_cfg):
    from speedllm.parallel.offload import MIN_BYTES, _Saved, apply_activation_offload
    from speedllm.parallel.parallelize import apply_recompute

    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for offload in (False, True):
        model = tiny(tiny_model_cfg)
        if recompute != "none":
            apply_recompute(model, recompute)
        hooks = apply_activation_offload(model) if offload else None
        ce_sum, aux = model(tokens, labels=tokens)
        if offload:  # the last layer's saved activations are held by the hooks (on CPU the host copy is the
            # tensor itself): activations of at least MIN_BYTES, never a weight
            held = list(hooks.last.saved)
            weights = {p.data_ptr() for p in model.parameters()}
            assert held and all(isinstance(s, _Saved) and s.host.device.type == "cpu" for s in held)
            assert all(s.host.nbytes >= MIN_BYTES and s.host.data_ptr() not in weights for s in held)
        ce_sum.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name


def test_optimizer_update_with_host_states_is_the_plain_update(tiny_model_cfg):
    from speedllm.parallel.offload import states_to_host, step_with_host_states
    from speedllm.train.optimizer import build_optimizer

    optim = compose_config("optim=adamw").optim
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    results = []
    for host in (False, True):
        model = tiny(tiny_model_cfg)
        optimizer = build_optimizer(model, optim)
        for _ in range(3):
            model(tokens, labels=tokens)[0].backward()
            step_with_host_states(optimizer) if host else optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if host:
            states_to_host(optimizer)
            assert all(len(params) for params in (g["params"] for g in optimizer.param_groups))  # groups restored
        results.append((model.state_dict(), optimizer.state_dict()))
    (weights, state), (host_weights, host_state) = results
    for name in weights:
        assert torch.equal(weights[name], host_weights[name]), name
    for index, values in state["state"].items():
        for key, value in values.items():
            assert torch.equal(value, host_state["state"][index][key]), (index, key)


def test_offload_params_builds_fsdp2_with_its_cpu_offload_policy():
    """The dry run's fake process group builds rank 0 of an fsdp2 job as training does: every FSDP2 unit holds
    CPUOffloadPolicy, unpinned for a CPU device (pinning needs an accelerator)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from speedllm.config.schema import typed
    from speedllm.runtime import init_fake_runtime
    from speedllm.train.build import meta_model

    cfg = typed(compose_config("model=qwen3_tiny", "parallel=fsdp2", "parallel.offload=params", "hardware=cpu", "hardware.dtype=float32",
                               "run_dir=."))
    try:
        pm = meta_model(cfg, init_fake_runtime(cfg, 0, 2))
        units = [m for m in pm.module.modules() if isinstance(m, FSDPModule)]
        policies = [m._get_fsdp_state()._fsdp_param_group.offload_policy for m in units]
        assert len(units) == cfg.model.num_hidden_layers + 1
        assert all(isinstance(p, CPUOffloadPolicy) and not p.pin_memory for p in policies)
    finally:
        torch.distributed.destroy_process_group()
