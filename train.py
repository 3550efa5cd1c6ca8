"""Train a Hugging Face causal LM with DeepSpeed ZeRO. One run, top to bottom:
config -> distributed -> tokenizer -> data -> model -> engine -> loop -> export.

    # the embedded default (tiny Llama, offline tokenizer and corpus), CPU or GPU
    deepspeed train.py --deepspeed ds_configs/zero3.json

    # a recipe, with overrides; fragments merge left to right
    deepspeed --num_gpus 8 train.py --recipe recipes/tiny-llama.yaml \
        --deepspeed ds_configs/zero3.json ds_configs/offload_all.json ds_configs/bf16.json --learning_rate 1e-4

    # torchrun works the same; so does srun (tools/slurm) and deepspeed --hostfile for many nodes
    torchrun --nproc_per_node 2 train.py --deepspeed ds_configs/zero2.json

    # check a config without training
    python train.py --recipe recipes/tiny-llama.yaml --deepspeed ds_configs/zero3.json --dry_run

`python train.py --help` lists every option; recipes use the same names.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

# torch._dynamo and transformers' model code must be imported before any zero.Init (measured: importing
# them inside it breaks); model.causal_lm_class() imports the model code itself.
import torch
import torch._dynamo  # noqa: F401

import psutil

PROCESS_START = psutil.Process().create_time()  # time to first step counts the imports too
NAN_TEST_STEP = int(os.environ.get("ZERO_RECIPES_TEST_NAN_AT_STEP", 0))  # test hook, see tests/test_faults.py

from zero_recipes import checkpoint, data, distributed, ds_config, memory, metrics, model as modeling
from zero_recipes.engine import make_engine

# DeepSpeed still calls the c10d collectives torch renamed; the warning is theirs, repeated every step.
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated")
from zero_recipes.config import ConfigError, help_text, parse_args, run_signature


def main(argv: list[str]) -> int:
    # ---- config: schema <- recipe <- flags; DeepSpeed JSON merged and checked before anything runs --
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    cfg, explicit = parse_args(argv)
    rank, local_rank, world, local_world = distributed.rank_info()
    log = print if rank == 0 else (lambda *a, **k: None)
    raw_ds = ds_config.load_fragments(cfg.deepspeed) if cfg.deepspeed else {}
    model_config = modeling.load_model_config(cfg)
    ds, notes = ds_config.resolve(raw_ds, cfg, explicit, world, modeling.hidden_size(model_config),
                                  total_steps=cfg.max_steps if cfg.max_steps > 0 else None)
    if cfg.dry_run:
        return dry_run(cfg, ds, notes, model_config, world, log)
    report_to = metrics.report_targets(cfg.report_to)  # a tracker asked for but not installed fails here
    for spec in data.dataset_specs(cfg):  # a missing file or bad mixture fails here, before any process group
        if not spec.name.startswith("builtin:"):
            data.describe(spec, cfg)
    output_dir = Path(cfg.output_dir)
    resume = checkpoint.check_output_dir(output_dir, run_signature(cfg, raw_ds), cfg.overwrite_output_dir,
                                         cfg.resume_from_checkpoint)

    # ---- distributed ----------------------------------------------------------------------------------
    threads = distributed.set_threads(local_world)
    distributed.init()
    distributed.quiet_deepspeed()
    stop_request = distributed.StopRequest()
    for note in notes:
        log(f"config: {note}")
    log(f"distributed: {world} rank(s), backend {torch.distributed.get_backend()}, {threads} thread(s) per rank")

    # ---- tokenizer and data: rank 0 builds the caches while the others wait, then everyone reads them ---
    tokenizer = rank0_first(rank, lambda: data.load_tokenizer(cfg))
    if cfg.streaming:
        prepared = data.prepare_stream(cfg, tokenizer, rank, world, log)
        order = prepared.train
    else:
        prepared = rank0_first(rank, lambda: data.prepare(cfg, tokenizer, log))
        order = data.BatchOrder(prepared.train, cfg.per_device_train_batch_size, rank, world, cfg.seed, prepared.pad_id)
    steps_per_epoch = order.per_rank // cfg.gradient_accumulation_steps
    total_steps = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.num_train_epochs * steps_per_epoch))

    # ---- every "auto" resolved now, before the model exists (zero.Init reads the config) -------------
    if cfg.model_name_or_path is None and cfg.model_config is None:
        model_config.vocab_size = len(tokenizer)  # the embedded model is sized to the embedded tokenizer
    elif len(tokenizer) > model_config.get_text_config().vocab_size:
        raise ConfigError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                          f"{model_config.get_text_config().vocab_size}; use the model's own tokenizer")
    if cfg.model_name_or_path is None:  # random init: generate() must stop where the tokenizer ends text
        modeling.use_tokenizer_special_ids(model_config, tokenizer)
    ds, _ = ds_config.resolve(raw_ds, cfg, explicit, world, modeling.hidden_size(model_config), total_steps)
    # Only now, with the data and config known good, is output_dir touched: bad input leaves it as it was.
    torch.distributed.barrier()  # every rank has read output_dir before rank 0 writes to it
    if rank == 0:
        if cfg.overwrite_output_dir and cfg.resume_from_checkpoint is None:
            checkpoint.clear_previous_run(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.write_run_config(output_dir, run_signature(cfg, raw_ds), ds)
    zero3 = ds_config.zero_stage(ds) == 3
    dtype_name = "bf16" if ds["bf16"]["enabled"] else "fp16" if ds["fp16"]["enabled"] else "fp32"

    if torch.cuda.is_available() and rank == 0:  # warn before an OOM, with what would fit
        estimate, line = memory.for_run(model_config, ds, cfg, world)
        free = torch.cuda.get_device_properties(0).total_memory
        log(line)
        if estimate is not None and estimate.per_gpu["peak_bytes"] > free:
            log(f"warning: the estimate exceeds this GPU's {free / 2**30:.1f} GiB; see `python tools/estimate_memory.py "
                f"--model ... --table --gpu_memory {free / 2**30:.0f}GiB` for a config that fits")

    # ---- model: under ZeRO-3 it is built inside zero.Init, straight into partitions -------------------
    from transformers.integrations import HfDeepSpeedConfig

    hf_ds = HfDeepSpeedConfig(ds)  # noqa: F841 -- must stay alive while the model is built
    modeling.causal_lm_class(model_config)
    load_dtype = torch.bfloat16 if (dtype_name == "bf16" and cfg.model_name_or_path) else torch.float32
    model = modeling.build_model(cfg, model_config, load_dtype, rank)
    n_params = metrics.num_params(model)
    if zero3:
        log(f"model: built under zero.Init; rank {rank} holds {modeling.partition_numel(model)} of {n_params} "
            "parameters")
    flops_per_token = metrics.model_flops_per_token(model_config, cfg.block_size)
    log(f"model: {model_config.model_type}, {n_params / 1e6:.2f}M parameters, ZeRO stage "
        f"{ds_config.zero_stage(ds)}, {dtype_name}, attention {cfg.attn_implementation}")

    # ---- engine ------------------------------------------------------------------------------------
    where = checkpoint.resolve_resume(output_dir, resume)
    saved = checkpoint.layout_change(where, world, ds_config.zero_stage(ds)) if where is not None else None
    original = where
    if saved is not None:
        if cfg.streaming:
            raise ConfigError(f"this streamed run was saved by {saved['world']} rank(s); a stream's per-rank "
                              "position cannot move to another world size. Resume with the same number of ranks")
        log(f"resume: {where[1]} was saved by {saved['world']} rank(s) with ZeRO-{saved['zero_stage']}, this run has "
            f"{world} with ZeRO-{ds_config.zero_stage(ds)}; converting it with DeepSpeed's universal checkpoint")
        where = checkpoint.to_universal(where, rank)
        ds.setdefault("checkpoint", {})["load_universal"] = True
    engine = make_engine(cfg, model, ds, total_steps)
    if cfg.torch_compile:  # DeepSpeed's own compile support: it knows which hooks must stay outside the graph
        engine.compile()
        log("model: compiled with torch.compile (DeepSpeed engine.compile); the first step includes compilation")
    hf_writer = modeling.hf_files_writer(engine.module.config, tokenizer)
    step = 0
    if where is not None:
        state, rank_state = checkpoint.load(engine, where, rank)
        step = int(state.get("step", engine.global_steps))
        position = checkpoint.data_position(original, rank_state, saved is not None, cfg.per_device_train_batch_size,
                                            world)
        if position is not None:
            order.load_state_dict(position)
        log(f"resume: loaded {where[0] / where[1]} at step {step}")
    elif resume is not None:
        log(f"resume: no checkpoint in {output_dir}, starting from scratch")

    # ---- loop --------------------------------------------------------------------------------------
    peak, peak_source = metrics.device_peak_flops(dtype_name)
    log(f"plan: {total_steps} steps x {ds['train_batch_size']} sequences x {cfg.block_size} tokens; "
        f"{flops_per_token / 1e6:.1f} MFLOP/token; peak {peak / 1e12:.2f} TFLOP/s ({peak_source})")
    mlog = metrics.MetricsLog(output_dir / "metrics.jsonl", rank == 0, resumed_at=step if where is not None else None,
                              report_to=report_to, run_name=cfg.run_name, config=run_signature(cfg, raw_ds))
    device = engine.device
    tokens_per_step_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.block_size
    bar = progress_bar(rank, total_steps, step)
    loss_sum = torch.zeros((), device=device)
    first_bad = torch.zeros((), dtype=torch.long, device=device)
    window_steps, window_start, data_wait = 0, time.perf_counter(), 0.0
    first_loss = last_loss = None
    # SFT rows hold different numbers of trained tokens: normalise each step by the tokens of all its micro-
    # batches on all ranks (HF's num_items_in_batch), not by a mean of per-micro-batch means.
    count_label_tokens = prepared.sft
    time_to_first_step = None
    start_step, run_start = step, time.perf_counter()
    if cfg.eval_on_start and step == 0:
        ev = evaluate(engine, prepared, cfg, rank, world, device)
        if ev:
            mlog.write({"step": 0, **ev})
            log(f"eval: step 0 {format_eval(ev)}")
        window_start = time.perf_counter()
    engine.train()
    # ZeRO-0 in fp32 runs without a DeepSpeed optimizer wrapper, which is what records the grad norm
    measure_grad_norm = ds_config.zero_stage(ds) == 0 and dtype_name == "fp32"
    own_grad_norm = None
    while step < total_steps:
        logging_step = (step + 1) % cfg.logging_steps == 0 or step + 1 == total_steps
        t = time.perf_counter()
        micro_batches = [{k: v.to(device, non_blocking=True) for k, v in order.next_batch().items()}
                         for _ in range(cfg.gradient_accumulation_steps)]
        data_wait += time.perf_counter() - t
        # no KV cache in training: with one, transformers would ignore the restarting position ids of packed rows
        extra = {"use_cache": False}
        if count_label_tokens:
            n_items = sum((b["labels"][:, 1:] != -100).sum() for b in micro_batches).float()
            torch.distributed.all_reduce(n_items)
            # DeepSpeed divides by the accumulation steps and averages over ranks; undo both here
            extra["num_items_in_batch"] = n_items.clamp(min=1) / (cfg.gradient_accumulation_steps * world)
        for micro, batch in enumerate(micro_batches):
            loss = engine(**batch, **extra).loss
            if step + 1 == NAN_TEST_STEP:  # test hook: a real backward and step on a NaN loss
                loss = loss * float("nan")
            engine.backward(loss)
            if measure_grad_norm and logging_step and micro == cfg.gradient_accumulation_steps - 1:
                own_grad_norm = torch.nn.utils.get_total_norm([p.grad for p in engine.module.parameters()
                                                               if p.grad is not None])
            engine.step()
            loss_sum += loss.detach()
            # the first step with a non-finite loss, kept on the device: no host sync until a check
            first_bad = torch.where((first_bad == 0) & ~torch.isfinite(loss.detach()), step + 1, first_bad)
        step += 1
        window_steps += 1
        if time_to_first_step is None:
            time_to_first_step = time.time() - PROCESS_START
        bar.update(1)
        saving = (cfg.save_steps and step % cfg.save_steps == 0) or step == total_steps
        if saving or step % cfg.logging_steps == 0:
            # Before anything is logged or saved: did any rank see a NaN/inf loss? No NaN checkpoint is written.
            bad = torch.where(first_bad > 0, first_bad, torch.full_like(first_bad, 2**62))
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MIN)
            if bad.item() < 2**62:
                log(f"error: the loss became non-finite (NaN or inf) at step {bad.item()}; stopping without saving "
                    f"a checkpoint. Lower --learning_rate, keep --max_grad_norm on, or use bf16 instead of fp16; "
                    f"the last good checkpoint is {checkpoint.latest_tag(output_dir) or 'none'}")
                return 1
        if step % cfg.logging_steps == 0 or step == total_steps:
            # the only host sync of the loop: one all-reduce and .item() per logging window
            torch.distributed.all_reduce(loss_sum)
            mean_loss = loss_sum.item() / (window_steps * cfg.gradient_accumulation_steps * world)
            elapsed = time.perf_counter() - window_start
            tps = tokens_per_step_rank * window_steps / elapsed
            grad_norm = engine.get_global_grad_norm()
            grad_norm = own_grad_norm if grad_norm is None else grad_norm
            record = {"step": step, "epoch": round(order.epoch_progress, 4),
                      "loss": mean_loss, "lr": engine.get_lr()[0],
                      "grad_norm": float(grad_norm) if grad_norm is not None else None,
                      "tokens_per_sec": tps * world, "tokens_per_sec_per_device": tps,
                      "mfu": metrics.mfu(tps, flops_per_token, peak), "data_wait_frac": data_wait / elapsed,
                      **metrics.memory_stats()}
            if step - window_steps == start_step:  # the first record of this launch
                record["time_to_first_step"] = time_to_first_step
            mlog.write(record)
            bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{tps * world:.0f}")
            first_loss = mean_loss if first_loss is None else first_loss
            last_loss = mean_loss
            loss_sum.zero_()
            window_steps, window_start, data_wait = 0, time.perf_counter(), 0.0
        if (cfg.eval_steps and step % cfg.eval_steps == 0) or step == total_steps:
            ev = evaluate(engine, prepared, cfg, rank, world, device)
            if ev:
                mlog.write({"step": step, **ev})
                log(f"eval: step {step} {format_eval(ev)}")
            engine.train()
            window_start = time.perf_counter()  # eval time is not training throughput
        preempted = stop_request.agreed()
        if saving or preempted:
            path = checkpoint.save(engine, output_dir, step, {"step": step}, rank, cfg.save_total_limit,
                                   rank_state={"data": order.state_dict()}, hf_writer=hf_writer)
            window_start = time.perf_counter()
            bar.write(f"checkpoint: {path}") if rank == 0 else None
        if preempted and step < total_steps:
            bar.close()
            mlog.close()
            log(f"preempted: {preempted} received; checkpoint saved at {path} (step {step} of {total_steps}). "
                "Resume by launching the same command again (it continues from there), or with "
                "--resume_from_checkpoint auto")
            return 0
    bar.close()
    if step > start_step:
        log(f"train: {step - start_step} steps in {time.perf_counter() - run_start:.1f}s, "
            f"loss {first_loss:.4f} -> {last_loss:.4f}")
    else:
        log(f"train: already at step {step} of {total_steps}; nothing left to train")

    # ---- export: output_dir itself becomes a complete HF model directory ------------------------------
    modeling.export_hf_model(engine, tokenizer, output_dir, zero3, rank)
    log(f"export: AutoModelForCausalLM.from_pretrained('{output_dir}') loads the trained model")
    if cfg.verify_export:
        rows = prepared.probe_rows
        probe = (data.collate([rows.row(0)], prepared.pad_id) if rows is not None else order.next_batch())
        probe = probe["input_ids"][:1, :64].to(device)
        out_dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float16 if dtype_name == "fp16" else torch.float32
        diff = modeling.verify_export(engine, output_dir, probe, rank, out_dtype)
        if rank == 0:
            log(f"export check: max |logits(reloaded) - logits(engine)| = {diff:.3g}")
            mlog.write({"step": step, "export_max_abs_logit_diff": diff})
    mlog.close()
    return 0


def rank0_first(rank: int, fn):
    """Run fn on rank 0 first (it fills the caches), then on the others, which read them. A ConfigError
    on rank 0 is raised on every rank, so no rank waits forever at the barrier."""
    error = [None]
    result = None
    if rank == 0:
        try:
            result = fn()
        except ConfigError as e:
            error[0] = str(e)
    torch.distributed.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ConfigError(error[0])
    if rank != 0:
        result = fn()
    torch.distributed.barrier()
    return result


def evaluate(engine, prepared, cfg, rank, world, device) -> dict:
    """Token-weighted eval loss over the label tokens, and for SFT the exact-match accuracy: the share
    of eval examples whose every answer token is the model's argmax. Teacher-forced argmax on every
    answer token is exactly what greedy decoding would produce, so this is greedy exact match at the
    cost of one forward pass (and the same collectives on every rank, as ZeRO-3 needs)."""
    engine.eval()
    total = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, label tokens, matches, examples
    with torch.no_grad():
        for batch, weight in data.eval_batches(prepared.eval, cfg.per_device_eval_batch_size, rank, world,
                                               cfg.max_eval_batches, prepared.pad_id):
            batch, weight = {k: v.to(device) for k, v in batch.items()}, weight.to(device)
            target = batch.pop("labels")[:, 1:]
            logits = engine(**batch, use_cache=False).logits[:, :-1].float()
            valid = target != -100
            losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none",
                                                       ignore_index=-100)
            total[0] += (losses.sum(dim=1) * weight).sum()
            total[1] += (valid.sum(dim=1) * weight).sum()
            if prepared.exact_match:
                has_answer = valid.any(dim=1)
                right = ((logits.argmax(-1) == target) | ~valid).all(dim=1) & has_answer
                total[2] += (right * weight).sum()
                total[3] += (has_answer * weight).sum()
    torch.distributed.all_reduce(total)
    if total[1].item() == 0:
        return {}
    loss = (total[0] / total[1]).item()
    out = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50))}
    if prepared.exact_match and total[3].item() > 0:
        out["eval_exact_match"] = (total[2] / total[3]).item()
    return out


def format_eval(ev: dict) -> str:
    em = f" exact match {ev['eval_exact_match']:.1%}" if "eval_exact_match" in ev else ""
    return f"loss {ev['eval_loss']:.4f} perplexity {ev['eval_perplexity']:.2f}{em}"


def progress_bar(rank: int, total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=rank != 0, desc="train", unit="step", mininterval=1.0,
                dynamic_ncols=True, file=sys.stderr)


def dry_run(cfg, ds, notes, model_config, world, log) -> int:
    n = modeling.count_params_meta(model_config)
    tokens = ds["train_batch_size"] * cfg.block_size
    log("resolved DeepSpeed config:")
    log(json.dumps(ds, indent=2))
    for note in notes:
        log(f"note: {note}")
    steps = str(cfg.max_steps) if cfg.max_steps > 0 else f"{cfg.num_train_epochs} epoch(s); count known once the data is prepared"
    log(f"plan: model {model_config.model_type} {n / 1e6:.2f}M parameters; world {world}; ZeRO stage "
        f"{ds_config.zero_stage(ds)}; {'bf16' if ds['bf16']['enabled'] else 'fp16' if ds['fp16']['enabled'] else 'fp32'}; "
        f"{ds['train_batch_size']} sequences x {cfg.block_size} tokens = {tokens} tokens/step; steps {steps}; "
        f"{metrics.model_flops_per_token(model_config, cfg.block_size) * tokens / 1e12:.3f} TFLOP/step")
    log(memory.for_run(model_config, ds, cfg, world)[1])
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except ConfigError as e:
        # Bad input: one line that names the problem and the fix, no traceback. Every rank meets the same
        # error; rank 0 speaks for all. The others linger a moment before exiting, because the launchers
        # kill all ranks as soon as one exits non-zero, and that could silence rank 0 mid-print (seen).
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(3)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:
        if "loss scale already at minimum" in str(e):  # DeepSpeed's fp16 loss scaler gives up
            if int(os.environ.get("RANK", 0)) == 0:
                print("error: fp16 loss scale hit its minimum: the gradients keep overflowing. Use bf16 "
                      "(ds_configs/bf16.json), lower --learning_rate, or lower min_loss_scale in the fp16 block",
                      file=sys.stderr, flush=True)
        elif line := distributed.lost_peer(e):  # every surviving rank says it: each node's log shows the cause
            print(f"\nerror: {line}", file=sys.stderr, flush=True)  # \n: after tqdm's bar
        else:
            import traceback

            traceback.print_exc()
        code = 1
    metrics.close_open_logs()
    distributed.finish(code)
