"""Host-memory offload applied from outside the model: saved activations (train.activation_offload) and
optimizer states between steps (parallel.offload=optimizer). Parameter offload is FSDP2's own
(speedllm.parallel.fsdp.offload_policy). docs/offload.md has the user's view.

Activations: every decoder layer's forward runs under saved-tensor hooks that copy each tensor autograd saves
(weights excepted) to host memory, pinned, on a side stream so the copy overlaps the next ops; backward brings a
layer's tensors back on that stream when it first needs one of them, and starts bringing back the layer that ran
before it in forward (the next one backward reaches). The hooks sit on the recompute wrapper, so under
train.recompute they see only what recompute keeps: full recompute's layer input goes to the host; selective
recompute's kept matmul outputs stay in the checkpoint's own cache on the device.

Optimizer states: they live in (pinned) host memory between steps; the update runs on the device one parameter
at a time, bringing that parameter's states over and sending them back (MindSpeed's swap-optimizer), so the
device holds one parameter's states at most. Each parameter's update is the optimizer's own, so the numbers and
the checkpoints are those of an ordinary step.

On a CPU device the host is the device: nothing is pinned or copied (a tensor "moved" to the host is itself),
while the bookkeeping (hooks, per-layer fetch and prefetch, the per-parameter update) runs as on accelerators.
"""

import weakref
from functools import partial
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

HOST = torch.device("cpu")
MIN_BYTES = 1024  # smaller saved tensors stay on the device: a copy costs more than it frees


def moved(t: torch.Tensor, device: torch.device, non_blocking: bool = True) -> torch.Tensor:
    """`t` on `device` (a DTensor keeps its mesh and placements; its local tensor moves); host copies of device
    tensors go to pinned memory so both directions run asynchronously. `t` itself when it is there already."""
    if isinstance(t, DTensor):
        local = moved(t.to_local(), device, non_blocking)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    if t.device == device:
        return t
    if device.type == "cpu":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=non_blocking)
    return t.to(device, non_blocking=non_blocking)


class _Layer:
    """The tensors one forward call of one layer saved, and the call before it (backward reaches it next)."""

    def __init__(self, previous: Optional["_Layer"]):
        self.saved = weakref.WeakSet()  # a tensor's host copy lives as long as autograd's graph holds it
        self.previous = weakref.ref(previous) if previous is not None else None


class _Saved:
    """One saved tensor in host memory, and its device copy once backward (or a prefetch) brought it back."""

    __slots__ = ("host", "device", "layout", "layer", "copy", "ready", "__weakref__")

    def __init__(self, host, device, layout, layer):
        self.host, self.device, self.layout, self.layer = host, device, layout, layer
        self.copy, self.ready = None, None


class ActivationOffload:
    """Saved-tensor hooks entered around each decoder layer's forward (module hooks, see apply_activation_offload)."""

    def __init__(self):
        self.streams = {}  # device -> side stream for the copies (accelerators only)
        self.contexts = []  # entered hook contexts: layers may nest (a wrapper and the layer it wraps)
        self.last: Optional[_Layer] = None

    def enter(self, module, args) -> None:
        self.last = _Layer(self.last)
        context = torch.autograd.graph.saved_tensors_hooks(partial(self.pack, self.last), self.unpack)
        context.__enter__()
        self.contexts.append(context)

    def exit(self, module, args, output) -> None:
        self.contexts.pop().__exit__(None, None, None)

    def _stream(self, device: torch.device):
        if device.type == "cpu":
            return None
        if device not in self.streams:
            self.streams[device] = torch.get_device_module(device).Stream(device)
        return self.streams[device]

    def pack(self, layer: _Layer, t: torch.Tensor):
        local = t.to_local() if isinstance(t, DTensor) else t
        weight = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)  # FSDP2 gathers them again
        if weight or local.numel() * local.element_size() < MIN_BYTES or local.device.type == "meta":
            return t
        layout = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        stream = self._stream(local.device)
        if stream is None:
            host = local.detach()
        else:
            stream.wait_stream(torch.get_device_module(local.device).current_stream(local.device))
            with torch.get_device_module(local.device).stream(stream):
                host = moved(local.detach(), HOST)
            local.record_stream(stream)  # the allocator may reuse its memory only once the copy is done
        saved = _Saved(host, local.device, layout, layer)
        layer.saved.add(saved)
        return saved

    def _fetch(self, layer: Optional[_Layer]) -> None:
        """Start copying back every tensor `layer` saved that is not on the device yet."""
        if layer is None:
            return
        for saved in list(layer.saved):
            if saved.copy is not None:
                continue
            stream = self._stream(saved.device)
            if stream is None:
                saved.copy = saved.host
                continue
            with torch.get_device_module(saved.device).stream(stream):
                saved.copy = moved(saved.host, saved.device)
                saved.ready = stream.record_event()

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.copy is None:
            self._fetch(saved.layer)
        self._fetch(saved.layer.previous() if saved.layer.previous is not None else None)
        local = saved.copy
        if saved.ready is not None:
            current = torch.get_device_module(saved.device).current_stream(saved.device)
            current.wait_event(saved.ready)
            local.record_stream(current)
        if saved.layout is None:
            return local
        mesh, placements, shape, stride = saved.layout
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def apply_activation_offload(model: nn.Module) -> ActivationOffload:
    """Offload what every decoder layer of `model` (or of a pipeline stage) saves for backward (one set of hooks
    per model part, on the layers' recompute wrappers where there are some); returns the hooks' owner."""
    offload = ActivationOffload()
    for layer in model.layers.values():
        layer.register_forward_pre_hook(offload.enter)
        layer.register_forward_hook(offload.exit, always_call=True)
    return offload


def optimizer_step(optimizer: torch.optim.Optimizer, offload: str) -> None:
    """optimizer.step(); under parallel.offload=optimizer with its states kept in host memory."""
    if offload == "optimizer":
        step_with_host_states(optimizer)
    else:
        optimizer.step()


@torch.no_grad()
def states_to_host(optimizer: torch.optim.Optimizer) -> None:
    """Move every optimizer state tensor to (pinned) host memory, e.g. after a checkpoint loaded them."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = moved(value, HOST)
    _synchronize(optimizer)


@torch.no_grad()
def step_with_host_states(optimizer: torch.optim.Optimizer) -> None:
    """optimizer.step() for states kept in host memory: one parameter at a time, its states brought to its
    device for its update and sent back. Each call steps only that parameter (the other groups are empty for
    it), with its group's settings and learning rate."""
    groups = optimizer.param_groups
    params = [group["params"] for group in groups]
    try:
        for group in groups:
            group["params"] = []
        for group, own in zip(groups, params):
            for p in own:
                if p.grad is None:
                    continue
                device = (p.to_local() if isinstance(p, DTensor) else p).device
                state = optimizer.state[p]
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = moved(value, device)
                group["params"] = [p]
                optimizer.step()
                group["params"] = []
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = moved(value, HOST)
    finally:
        for group, own in zip(groups, params):
            group["params"] = own
    _synchronize(optimizer)


def _synchronize(optimizer: torch.optim.Optimizer) -> None:
    """Wait for the asynchronous copies into host memory: a checkpoint reads those tensors on the host."""
    devices = {(p.to_local() if isinstance(p, DTensor) else p).device for g in optimizer.param_groups
               for p in g["params"]}
    for device in devices - {HOST}:
        torch.get_device_module(device).synchronize(device)
