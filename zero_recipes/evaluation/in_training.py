"""--eval_tasks and --eval_samples: at each evaluation, lm-eval's tasks and greedy answers on the live model,
with no export round-trip.

Every rank runs the same requests in the same order on `engine.module`: under ZeRO-3 each forward gathers
the layers' partitions (a collective every rank must join), under TP each layer all-reduces its shards, so
the ranks stay in step because they do the same work; the answers are identical on every rank and rank 0
writes them. An axis whose forward takes slices of rows or stages of layers (SP, PP, EP) says why it cannot
(axis.ParallelAxis.live_eval_refusal) and the run is refused before it starts. lm-eval seeds Python, numpy and
torch on every call; the training RNG states are put back after, so evaluating does not change training.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

import numpy as np
import torch

from zero_recipes.checkpointing import storage
from zero_recipes.checkpointing.rng import rng_state, set_rng_state

from ..errors import ConfigError
from . import harness

SAMPLES_STEM = "eval_samples"
"""output_dir/eval_samples.html and .jsonl (run_dir.RUN_ENTRIES)."""
TEXT_PROMPT_TOKENS = 32
"""Plain-text data: a held-out row's first tokens are the prompt, the next as many the reference."""


def check(plan) -> Optional[harness.TaskSelection]:
    """Before any process group: refuse what cannot evaluate live, and check the task names and YAMLs."""
    cfg = plan.cfg
    if not (cfg.eval_tasks or cfg.eval_samples):
        return None
    if why := plan.parallelism.live_eval_refusal:
        flag = "--eval_tasks" if cfg.eval_tasks else "--eval_samples"
        raise ConfigError(
            f"{flag} cannot run on this run's live model: {plan.mesh.describe()}: {why}; drop it and evaluate the "
            f"export after training: python tools/evaluate.py {cfg.output_dir} --tasks ..."
        )
    return harness.select_tasks(cfg.eval_tasks) if cfg.eval_tasks else None


class LiveEval:
    """Built once in setup; `run(engine, step)` at each evaluation returns the values for metrics.jsonl."""

    def __init__(self, plan, selection, tokenizer, prepared, rank: int, log):
        from . import side_by_side

        self.cfg, self.selection, self.tokenizer, self.rank = plan.cfg, selection, tokenizer, rank
        self.synced = plan.zero_stage == 3 and plan.world > 1  # ZeRO-3's generate must keep every rank stepping
        self.page = plan.output_dir / SAMPLES_STEM
        # the prompts are the held-out rows' text as the run trains on it (an SFT row already in its template)
        self.decoding = side_by_side.Decoding(max_new_tokens=plan.cfg.eval_samples_max_new_tokens, chat_template=False)
        self.described = (
            f"greedy, at most {self.decoding.max_new_tokens} new tokens, the held-out row's text as trained"
        )
        self.prompts = held_out_prompts(prepared, tokenizer, plan.cfg.eval_samples) if plan.cfg.eval_samples else []
        if plan.cfg.eval_samples and not self.prompts:
            log("eval: --eval_samples has no held-out rows to take prompts from (a stream without eval data)")
        self.chat = harness.wants_chat_template("auto", tokenizer)  # an SFT run's tokenizer has its template
        if selection:
            log(
                f"eval: lm-eval tasks {', '.join(selection.names)} on the live model at each evaluation"
                + (" (chat template applied)" if self.chat else "")
            )

    def run(self, engine, step: int) -> dict:
        state = rng_state()  # what a checkpoint keeps (Python, numpy, torch), which lm-eval reseeds
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        out = {}
        try:
            with torch.random.fork_rng(devices=devices), quiet_unless(self.rank == 0):  # and the GPU's
                if self.selection:
                    out.update(self.tasks(engine.module))
                if self.prompts:
                    out.update(self.samples(engine.module, step))
        finally:
            set_rng_state(state)
        return out

    def tasks(self, model) -> dict:
        from lm_eval.models.huggingface import HFLM

        start = time.perf_counter()
        lm = HFLM(pretrained=model, tokenizer=self.tokenizer, batch_size=self.cfg.per_device_eval_batch_size)
        limit = harness.limit_of(self.cfg.eval_tasks_limit or None)
        # ZeRO-3: a generation's forwards gather weights from every rank, so each must run as many as the longest
        # (transformers decides synced_gpus from a ZeRO-3 config object that lives only while the model is built)
        synced = {"synced_gpus": True} if self.synced else None
        results = harness.run(lm, self.selection, limit=limit, chat_template=self.chat, gen_kwargs=synced)
        # lm-eval aggregates on the process whose LOCAL_RANK is 0 and returns None elsewhere; rank 0 logs
        scores = harness.flat_metrics(harness.scores(results)) if results is not None else {}
        return {**scores, "eval_tasks_seconds": time.perf_counter() - start}

    def samples(self, model, step: int) -> dict:
        from . import side_by_side

        start = time.perf_counter()
        answers = side_by_side.generate(model, self.tokenizer, self.prompts, self.decoding, synced=self.synced)
        if self.rank == 0:
            title = f"{self.cfg.output_dir}: held-out prompts during training"
            storage.or_warn(
                lambda: side_by_side.append_column(
                    self.page, self.prompts, f"step {step}", answers, self.described, title
                ),
                f"the samples page {self.page}",
                "it keeps its previous columns; training goes on",
            )
        return {"eval_samples_seconds": time.perf_counter() - start}


def held_out_prompts(prepared, tokenizer, n: int) -> list[dict]:
    """`n` held-out rows spread over the eval set, as prompts with their reference answers: an SFT row's
    prompt is everything before its first trained token (already in the chat template the run trains with)
    and its reference the trained tokens; a text row's first TEXT_PROMPT_TOKENS tokens and the next as many."""
    rows = prepared.held_out_rows
    if rows is None or not hasattr(rows, "row") or not len(rows):
        return []
    picks = np.unique(np.linspace(0, len(rows) - 1, num=min(n, len(rows))).round().astype(int))
    prompts = []
    for i in picks:
        tokens, mask = rows.row(int(i))[0]
        if mask is None:
            prompt, reference = tokens[:TEXT_PROMPT_TOKENS], tokens[TEXT_PROMPT_TOKENS : 2 * TEXT_PROMPT_TOKENS]
        else:
            first = int(np.argmax(mask != 0)) if mask.any() else len(tokens)
            prompt, reference = tokens[:first], tokens[first:][mask[first:] != 0]
        text = tokenizer.decode(prompt.tolist())
        answer = tokenizer.decode(reference.tolist(), skip_special_tokens=True)
        prompts.append({"prompt": text, "reference": answer.split("<|im_end|>")[0].strip() or None})
    return prompts


@contextlib.contextmanager
def quiet_unless(speaking: bool):
    """The other ranks run the same evaluation; only rank 0's progress bars and lm-eval notes are shown."""
    if speaking:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null), contextlib.redirect_stdout(null):
        yield
