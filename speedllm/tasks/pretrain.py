"""task=pretrain and task=sft: one loop, read top to bottom.

A step consumes global_batch_size sequences, its loss exact whatever the split (speedllm.train.step).
SFT is the same loop; its loader masks every label outside the assistant turns with IGNORE_INDEX.
"""

import math
import time

from speedllm import storage
from speedllm.checkpoint.dcp import latest_checkpoint
from speedllm.planner.spec import TRAIN_LOOP
from speedllm.runtime import Runtime, seed_everything
from speedllm.train.build import build_training, grad_accum_steps, to_device, training_loop
from speedllm.train.faults import BadSteps, Preemption
from speedllm.train.metrics import expert_load_metrics, flops_per_token, mfu, peak_devices, peak_memory_gb
from speedllm.train.samples import print_samples
from speedllm.train.state import extra_state
from speedllm.train.step import evaluate, train_step


def run(cfg, rt: Runtime) -> None:
    """Train (task=pretrain) or fine-tune (task=sft) per cfg; checkpoints, metrics and samples go to the run dir."""
    t, ck = cfg.train, cfg.checkpoint
    seed_everything(cfg.seed)
    dp_rank, dp_size, group = rt.dims.coords("dp")
    accum = grad_accum_steps(t, dp_size)
    pm, optimizer, scheduler, loader, autocast, step, resume_from = build_training(cfg, rt)
    logger, checkpointer, stop_at = training_loop(cfg, rt, step)

    def checkpoint() -> None:
        extra = extra_state(step, scheduler, loader, rt.device)
        saved = checkpointer.save(step, pm.module, optimizer, extra, cfg)
        logger.message(f"checkpoint: step {step} {'saving in the background' if ck.async_save else 'saved'} to "
                       f"{saved}")

    tokens_per_step = t.global_batch_size * t.seq_len
    flops_tok = flops_per_token(cfg.model, t.seq_len)
    peak_tflops = cfg.hardware.peak_tflops[cfg.hardware.dtype]
    bad = BadSteps(t.max_bad_steps)
    window_losses, window_time, window_steps = [], 0.0, 0
    last_saved = step if resume_from is not None else None
    first_step = step
    try:
        with Preemption() as preemption:
            while step < stop_at:
                start = time.perf_counter()
                lr = scheduler.get_last_lr()[0]
                micro_batches = [to_device(next(loader), rt.device) for _ in range(accum)]  # endless loader
                loss, grad_norm, ok = train_step(pm, optimizer, scheduler, micro_batches, cfg, dp_size, group,
                                                 autocast)
                step += 1
                window_time += time.perf_counter() - start  # .item() above synchronized the device
                if pm.pipeline is not None and step == first_step + 1:
                    logger.message(pm.pipeline.describe())  # the schedule that ran and where its stages are
                window_steps += 1
                bad.record(ok, step)
                if ok:
                    window_losses.append(loss)
                logger.advance(step)
                if step % t.log_every == 0 or step == stop_at:
                    tokens_per_s = window_steps * tokens_per_step / window_time
                    achieved = mfu(tokens_per_s, flops_tok, peak_tflops, peak_devices(cfg, rt.world_size))
                    expert_load = expert_load_metrics(pm.module, cfg.model, rt.device) if pm.module.has_moe else {}
                    logger.log(step, {
                        "loss": sum(window_losses) / len(window_losses) if window_losses else math.nan,
                        "lr": lr,
                        "grad_norm": grad_norm, "consumed_samples": loader.consumed_samples,
                        "tokens_per_s": tokens_per_s,
                        "tflops": tokens_per_s * flops_tok / rt.world_size / 1e12, "mfu": achieved,
                        "peak_mem_gb": peak_memory_gb(rt.device), "skipped_steps": bad.total, **expert_load})
                    window_losses, window_time, window_steps = [], 0.0, 0
                if t.eval_every > 0 and step % t.eval_every == 0:
                    valid_loss = evaluate(pm, cfg, dp_rank, dp_size, group, rt.device, autocast)
                    logger.log(step, {"loss": valid_loss, "ppl": math.exp(min(valid_loss, 50.0))}, prefix="valid")
                if ck.every > 0 and step % ck.every == 0 and bad.in_a_row == 0:  # never save a suspect state
                    checkpoint()
                    last_saved = step
                if preemption.any_rank(rt.device):
                    logger.message(f"SIGTERM: saving a checkpoint at step {step} and exiting")
                    break
        if last_saved != step and (ck.save_final or step < t.steps):  # stopped early: always save
            checkpoint()
        checkpointer.close()
    finally:
        logger.close()
    root = storage.absolute(ck.dir)
    if rt.is_main and latest_checkpoint(str(root)) is not None:
        print(f"checkpoint: {latest_checkpoint(str(root))}\n"
              f"  generate: python launch.py task=generate checkpoint.load={root} generate.prompt=\"ROMEO:\"\n"
              f"  resume:   the same command plus checkpoint.load={root} (raise train.steps to train further)")
    if step >= t.steps and cfg.generate.num_samples > 0:
        if pm.pipeline is None:
            print_samples(pm.module, cfg, rt.is_main)
        elif rt.is_main:
            print("samples skipped: generation does not run on pipeline stages (parallel.pp > 1)")


SPEC = TRAIN_LOOP  # pretraining and SFT: the training rules (speedllm.planner.spec)
