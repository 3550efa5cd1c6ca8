"""The contract every training mode owes, as one table: a row per mode, a test file per column
(tests/integration/contract/), in the manner of torchtitan's `OverrideDefinitions`.

The columns, each a file of tests/integration/contract/:

    test_parity.py   fp32 per-step losses (and gradient norms) equal to the row's ZeRO-0 baseline on the same
                     global batch, within `parity`; the log says what makes the row this mode (`says`)
    test_resume.py   "kill": SIGKILL a rank right after the step-4 checkpoint, relaunch the same command, and
                     steps 5-8 repeat the uninterrupted run's losses bit for bit; "step4": relaunch from a copy
                     of the run's step-4 checkpoint (what a kill after that save leaves), bit for bit too
    test_export.py   the export train.py wrote reloads with the engine's logits (`export_tol`); where
                     tools/export_hf.py applies, its export equals train.py's, or it refuses in one line
    test_layout.py   a resume on another layout (`layouts`) is converted and continues within its bound, or is
                     refused in one line with the checkpoint untouched

A new mode or objective is a row here (about 90 s of test time: docs/dev/test-suite.md#budget), not a file of
copies. A row that does not take a column says why in `skips`. What is particular to one axis (the mesh drawn,
an expert's balancing loss, a pipeline's layer files) stays in that axis's test file, reading the same runs.

Every row's run is trained once per pytest invocation, whichever xdist worker asks first (shared_runs.py), by
`conftest.mode_run`; the ZeRO rows are the `trained` fixture's fp32 runs themselves.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from helpers import CONFIGS, FAST
from zero_recipes.config.shipped import EXPERT_PARALLEL, PIPELINE_PARALLEL, SEQUENCE_PARALLEL, TENSOR_PARALLEL

PARITY = 1e-5  # fp32 losses and export logits; measured max 9.5e-7 (losses) and 8e-7 (logits) over the rows
NORM_PARITY = 1e-4  # relative; measured 5e-5 (PP against the ZeRO-0 baseline's own norm)

# What the argument lists name, filled in by conftest.mode_run: a pretrained base to adapt (LoRA: the session's
# ZeRO-3 fp32 run; QLoRA: one whose layers are 64-wide, as bitsandbytes' CPU 4-bit kernel needs).
LORA_BASE, QLORA_BASE = "{lora_base}", "{qlora_base}"
DPO_PAIRS = "{dpo_pairs}"  # a small preference file (conftest.make_dpo_pairs)


@dataclass(frozen=True)
class Layout:
    """A resume of the row's step-4 checkpoint on another layout: `args` replace the row's fragments and batch.
    `tol` None: refused before any process group, `says` in the one error line; otherwise converted, `says` in
    the resumed run's log, and its losses for steps 5-8 within `tol` of the uninterrupted run's."""

    id: str
    args: tuple[str, ...]
    nproc: int
    says: tuple[str, ...]
    tol: float | None = None


@dataclass(frozen=True)
class Mode:
    name: str
    args: tuple[str, ...]  # after helpers.FAST: fragments, batch, model
    nproc: int = 2
    baseline: str = "zero0"  # "zero0" (conftest's `trained`) or a key of BASELINES
    says: tuple[str, ...] = ()  # lines in the run's log that make it this mode
    parity: float = PARITY
    norm_parity: float = NORM_PARITY  # relative, of each step's gradient norm against the baseline's
    resume: str = "step4"  # "kill" | "step4" | "" (see skips)
    export_tol: float = PARITY
    export_tool: str = ""  # "equal" | "refused: <words of its one line>" | "" (see skips)
    layouts: tuple[Layout, ...] = ()
    skips: dict[str, str] = field(default_factory=dict)  # column -> why this row does not take it
    watch: str = ""  # a test module whose launch() watches the row's ranks as they train: export_memory, muon_calls
    family: str = "zero"

    def __post_init__(self):
        takes = {"resume": bool(self.resume), "export_tool": bool(self.export_tool), "layout": bool(self.layouts)}
        missing = [c for c, took in takes.items() if not took and not self.skips.get(c)]
        extra = [c for c in self.skips if takes.get(c, True)]
        assert not missing and not extra, f"{self.name}: say why it skips {missing}; it takes {extra}"


def micro(nproc: int) -> tuple[str, ...]:
    """The baseline's 8 sequences a step when pairs of ranks share each row (TP, SP): one replica per 2 ranks."""
    return ("--per_device_train_batch_size", str(8 // (nproc // 2)))


def batch(micro: int, accumulation: int) -> tuple[str, ...]:
    return ("--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", str(accumulation))


# ---- the baselines: ZeRO-0 on the same global batch (2 ranks x micro 4, 8 sequences a step) ---------------
MOE_SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 4096}
MOE_SHAPE |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
MOE_MODEL = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, **MOE_SHAPE}
MOE_COEF = 0.05  # large enough to move the losses: a run that dropped the balancing loss fails parity
MOE = ("--model_config", json.dumps(MOE_MODEL), "--router_aux_loss_coef", str(MOE_COEF))
LORA = ("--lora_r", "8", "--lora_alpha", "16", "--learning_rate", "1e-2")
QLORA = (*LORA, "--load_in_4bit")


def dpo_reference(name: str) -> str:
    """A placeholder for the file of a row's reference log-probs (conftest.bases: under the invocation's runs)."""
    return f"{{dpo_reference:{name}}}"


def dpo(name: str) -> tuple[str, ...]:
    """DPO on the preference file from the initial model. Each run keeps its reference log-probs in a file of its
    own, so each row computes them with its own engine (ZeRO-3's gathers, TP) instead of reading a sibling's."""
    ref = dpo_reference(name)
    return ("--objective", "dpo", "--dataset_name", DPO_PAIRS, "--block_size", "128", "--learning_rate", "1e-3",
            "--validation_split_percentage", "10", "--eval_steps", "8", "--reference_cache", str(ref))  # fmt: skip


BASELINES = {  # name -> (args after FAST, shared-run key); "zero0" is the `trained` fixture's fp32 run itself
    "moe-zero0": ((*CONFIGS["zero0"], *MOE), "moe-zero0"),
    # its export is checked too (adapters/test_lora.py): LoRA on ZeRO-0 is a mode users run
    "lora-zero0": ((*CONFIGS["zero0"], "--model_name_or_path", LORA_BASE, *LORA, "--verify_export"), "lora-zero0"),
    "qlora-zero0": ((*CONFIGS["zero0"], "--model_name_or_path", QLORA_BASE, *QLORA), "qlora-zero0"),
    "dpo-zero0": ((*CONFIGS["zero0"], *dpo("dpo-zero0")), "dpo-zero0"),
    "dpo-lora-zero0": (
        (*CONFIGS["zero0"], *dpo("dpo-lora-zero0"), "--model_name_or_path", LORA_BASE, *LORA),
        "dpo-lora-zero0",
    ),
    "muon-zero0": ((*CONFIGS["zero0"], "ds_configs/muon.json"), "muon-zero0"),
}


# ---- the rows -----------------------------------------------------------------------------------------
def zero_rows() -> list[Mode]:
    def universal(saved: str, resumed: str, nproc: int, tol: float) -> Layout:
        """ZeRO's universal checkpoint (ds_to_universal, load_universal), converted by train.py itself."""
        return Layout(
            f"{saved} 2->{nproc} ranks" if saved == resumed else f"{saved}->{resumed} {nproc} ranks",
            (*CONFIGS[resumed], "--gradient_accumulation_steps", str(2 // nproc)),
            nproc,
            ("converting it with DeepSpeed's universal checkpoint", "step-4-universal at step 4"),
            tol,
        )

    offload = {
        "export_tool": "checkpointing/test_export_tool.py exports ZeRO-1/2/3 checkpoints (sharded, with index and "
        "tokenizer); offload changes where the states live, not the files",
        "layout": "the same ZeRO partitions as the row without offload (its layout column); only where they live differs",
    }  # fmt: skip
    plain = {"export_tool": offload["export_tool"]}
    return [
        Mode("zero1", CONFIGS["zero1"], resume="kill", skips=plain, layouts=(
            universal("zero1", "zero1", 1, 1e-5), universal("zero1", "zero2", 2, 1e-5))),
        Mode("zero2", CONFIGS["zero2"], resume="kill", skips=plain, layouts=(
            universal("zero2", "zero2", 1, 1e-5), universal("zero2", "zero1", 2, 1e-5))),
        # ZeRO-3 -> ZeRO-2 is refused through the real launcher (checkpointing/test_universal_resume.py)
        # ZeRO-3's universal load does not restore Adam's state exactly: step 5 matches to 1e-6, the updates then
        # differ (1.5e-4 at step 6, 5.4e-3 at step 8, measured)
        Mode("zero3", CONFIGS["zero3"], resume="kill", skips=plain, layouts=(universal("zero3", "zero3", 1, 1e-2),)),
        # DeepSpeed's C++ CPU Adam steps the offloaded states; resumed from a copy of the step-4 checkpoint, its
        # losses for steps 5-8 equal the uninterrupted run's bit for bit (measured, both rows)
        Mode("zero2+offload_optimizer", CONFIGS["zero2+offload_optimizer"], skips=offload),
        Mode("zero3+offload_all", CONFIGS["zero3+offload_all"], skips=offload),
        Mode("zero3+nvme", CONFIGS["zero3+nvme"], resume="", skips={
            "resume": "the offloaded states are zero3+offload_all's, swapped to files by DeepSpeed's async I/O",
            **offload,
        }),
    ]  # fmt: skip


def tensor_parallel_rows() -> list[Mode]:
    tp2 = TENSOR_PARALLEL[2]

    others = {
        "resume": "tp2-zero1 (ZeRO-1/2's TP checkpoint: killed) and tp2-zero3 resume it",
        "export_tool": "tp2-zero1's and tp2xdp2-zero2's (shards merged), tp2-zero3's (refused)",
        "layout": "tp2-zero1's and tp2-zero3's",
    }

    def row(name, nproc, combo, **kw) -> Mode:
        says = (f"distributed: {nproc} ranks = {nproc // 2} data-parallel x 2 tensor-parallel",)
        says += ("plan: 8 steps x 8 sequences x 64 tokens",)  # the "auto" batch counts replicas, not ranks
        kw.setdefault("resume", "")
        takes = {"resume": kw["resume"], "export_tool": kw.get("export_tool"), "layout": kw.get("layouts")}
        skips = {c: why for c, why in others.items() if not takes[c]}
        return Mode(name, (*CONFIGS[combo], tp2, *micro(nproc)), nproc, says=says, skips=skips, family="tp", **kw)

    return [
        row("tp2-zero1", 2, "zero1", resume="kill", export_tool="equal", layouts=(
            Layout("1->2 replicas", (*CONFIGS["zero1"], tp2, *micro(4)), 4, (
                "saved by 1 data-parallel x 2 tensor-parallel rank(s) with ZeRO-1, this run has 2 data-parallel",
                "step-4-universal at step 4",
            ), PARITY),
            Layout("tp2->tp1", (*CONFIGS["zero1"], *micro(2)), 2, ("saved with tensor_parallel.autotp_size 2 at autotp_size 1",)),
        )),
        row("tp2-zero2", 2, "zero2"),
        row("tp2-zero3", 2, "zero3", resume="step4", export_tool="refused: the output_dir it finishes is the exported model",
            layouts=(Layout("zero3 1->2 replicas", (*CONFIGS["zero3"], tp2, *micro(4)), 4,
                            ("Resume with 1 data-parallel x 2 tensor-parallel ranks and ZeRO-3",)),)),
        row("tp2-zero2-offload", 2, "zero2+offload_optimizer"),
        row("tp2-zero3-offload", 2, "zero3+offload_all"),
        row("tp2xdp2-zero1", 4, "zero1"),
        row("tp2xdp2-zero2", 4, "zero2", export_tool="equal"),
        row("tp2xdp2-zero3", 4, "zero3"),
    ]  # fmt: skip


def sequence_parallel_rows() -> list[Mode]:
    sp2 = SEQUENCE_PARALLEL[2]

    def row(name, nproc, combo, **kw) -> Mode:
        says = (f"distributed: {nproc} ranks = {nproc // 2} data-parallel x 2 sequence-parallel",)
        says += ("plan: 8 steps x 8 sequences x 64 tokens",)
        return Mode(name, (*CONFIGS[combo], sp2, *micro(nproc)), nproc, says=says, family="sp", **kw)

    return [
        row("sp2-zero1", 2, "zero1", resume="kill", export_tool="equal", layouts=(
            Layout("more replicas", (*CONFIGS["zero1"], sp2, *micro(4)), 4, (
                "this run has 2 data-parallel x 2 sequence-parallel with ZeRO-1", "step-4-universal at step 4"
            ), PARITY),
            # SP 2 -> 1: the weights are whole on every rank
            Layout("sp2->sp1", (*CONFIGS["zero1"], "--per_device_train_batch_size", "4"), 2, (
                "this run has 2 with ZeRO-1", "step-4-universal at step 4"
            ), PARITY),
        )),
        row("sp2-zero3", 2, "zero3", skips={"export_tool": "sp2-zero1's: SP keeps whole weights, so its checkpoint is "
            "plain ZeRO's", "layout": "sp2-zero1 changes the SP layout; ZeRO-3 conversions are the zero3 row's"}),
        row("sp2xdp2-zero3", 4, "zero3", resume="", skips={
            "resume": "sp2-zero3 resumes the same ZeRO-3 SP checkpoint on 2 ranks",
            "export_tool": "sp2-zero1's", "layout": "sp2-zero1's",
        }),
    ]  # fmt: skip


# Every block recomputed in backward (DeepSpeed's pipeline.activation_checkpoint_interval = 1), for pp2-zero1
CHECKPOINT_EVERY_BLOCK = Path(tempfile.mkdtemp(prefix="pp-fragment-")) / "pp2-checkpointed.json"
CHECKPOINT_EVERY_BLOCK.write_text('{"pipeline": {"stages": 2, "activation_checkpoint_interval": 1}}')


def pipeline_rows() -> list[Mode]:
    """8 sequences a step in every layout: PP2 on 2 ranks is one pipeline with 4 x 2 micro-batches, PP2 x DP2 on
    4 ranks two pipelines with 2 x 2. Clipping is on (DeepSpeed's default 1.0), so the gradient norm is the
    check on DeepSpeed's ZeRO-0 clipping under PP, which counts the first stage's gradients alone
    (docs/dev/deepspeed-bugs.md#clipping)."""
    pp2 = PIPELINE_PARALLEL[2]

    def row(name, nproc, zero, fragment, micro, **kw) -> Mode:
        says = (f"distributed: {nproc} ranks = {nproc // 2} data-parallel x 2 pipeline-parallel",)
        says += ("plan: 8 steps x 8 sequences x 64 tokens",)  # the "auto" batch counts pipelines, not ranks
        says += ("pipeline: 2 stages of 7 layers (embedding, 4 blocks, norm, head) by parameters",)
        args = (*CONFIGS[zero], fragment, *batch(micro, 2))
        return Mode(name, args, nproc, says=says, watch="export_memory", family="pp", **kw)

    return [
        row("pp2-zero0", 2, "zero0", pp2, 4, resume="kill", layouts=(
            # ZeRO-0: no partitions to move
            Layout("zero0 1->2 pipelines", (*CONFIGS["zero0"], pp2, *batch(2, 2)), 4,
                   ("every replica loads its stage's files as saved",), PARITY),
            Layout("2->4 stages", (*CONFIGS["zero0"], PIPELINE_PARALLEL[4]), 4,
                   ("saved with pipeline.stages 2 at 4 stage(s)", "tools/export_hf.py")),
        ), skips={"export_tool": "pp2xdp2-zero1's: the same layer files, saved by one pipeline"}),
        row("pp2-zero1", 2, "zero1", str(CHECKPOINT_EVERY_BLOCK), 4, resume="", skips={
            "resume": "pp2-zero0 resumes a pipeline's layer files; ZeRO-1's optimizer states are the zero1 row's",
            "export_tool": "pp2xdp2-zero1's", "layout": "pp2xdp2-zero1's",
        }),
        row("pp2xdp2-zero1", 4, "zero1", pp2, 2, resume="", export_tool="equal", layouts=(
            Layout("zero1 2->1 pipelines", (*CONFIGS["zero1"], pp2, *batch(4, 2)), 2,
                   ("step-4-universal at step 4",), PARITY),
        ), skips={"resume": "pp2-zero0 resumes a pipeline's layer files; this row's layout column resumes them too"}),
    ]  # fmt: skip


def expert_rows() -> list[Mode]:
    """Every run trains the baseline's 2 ranks x micro 4, each rank its own rows, so the two ranks route
    different tokens to different experts in every step: the case that hangs ZeRO-3 when experts are separate
    modules (transformers 5 packs a layer's experts into 3-D parameters, so every rank gathers all of them)."""
    ep2 = EXPERT_PARALLEL[2]
    says = (f"balancing loss: router_aux_loss_coef {MOE_COEF:g} x aux_loss",)
    says += ("active per token (4 experts, 2 per token, 2 of 2 layers sparse)",)
    split = ("experts split 2 ways", "each rank holds 2 of every layer's 4 experts")
    other = {"resume": "moe-zero2+ep2 resumes an MoE run; without EP the experts are ordinary ZeRO partitions",
             "export_tool": "moe-zero2+ep2's", "layout": "moe-zero2+ep2's"}  # fmt: skip

    def row(name, fragments, **kw) -> Mode:
        kw.setdefault("skips", other)
        kw.setdefault("resume", "")
        return Mode(name, (*fragments, *MOE), baseline="moe-zero0", watch="export_memory", family="moe", **kw)

    return [
        row("moe-zero1", CONFIGS["zero1"], says=says),
        row("moe-zero3", CONFIGS["zero3"], says=says),
        row("moe-zero2+ep2", (*CONFIGS["zero2"], ep2), says=says + split, resume="kill", export_tool="equal", layouts=(
            Layout("ep2->ep1", (*CONFIGS["zero2"], *MOE), 2,
                   ("resumes an expert-parallel run only on the layout it was saved with",)),
        ), skips={}),
        row("moe-zero3+ep2", (*CONFIGS["zero3"], ep2), says=says + split,
            export_tool="refused: ZeRO-3 + expert-parallel checkpoint", skips={
                "resume": other["resume"], "layout": other["layout"]}),
    ]  # fmt: skip


def adapter_rows() -> list[Mode]:
    """LoRA (peft) from a pretrained base on every stage against LoRA on ZeRO-0, and QLoRA (a bitsandbytes NF4
    base) on ZeRO-2 against QLoRA on ZeRO-0."""
    says = ("lora: r 8, alpha 16 on all-linear; trains", "the base frozen")
    stage = "lora-zero2 and lora-zero3 resume the adapter's states; a stage adds nothing LoRA-specific"
    layout = "lora-zero2's: a LoRA checkpoint resumes only on its own layout"

    def row(name, combo, **kw) -> Mode:
        zero3 = ("model: built under zero.Init",) if combo.startswith("zero3") else ()  # the base still partitioned
        kw.setdefault("skips", {"resume": stage, "export_tool": "lora-zero3's (adapters/test_lora.py: the adapter "
                                "and a merged model)", "layout": layout})  # fmt: skip
        kw.setdefault("resume", "")
        args = (*CONFIGS[combo], "--model_name_or_path", LORA_BASE, *LORA)
        return Mode(name, args, baseline="lora-zero0", says=says + zero3, family="lora", **kw)

    qlora_skips = {
        "resume": "the adapter's states resume as LoRA's; the 4-bit base is quantised again from its weights",
        "export_tool": "lora-zero3's", "layout": layout,
    }  # fmt: skip
    return [
        row("lora-zero1", "zero1"),
        row("lora-zero2", "zero2", resume="kill", skips={"export_tool": "lora-zero3's"}, layouts=(
            # DeepSpeed's universal conversion cannot carry a checkpoint without the base
            Layout("2->1 ranks", (*CONFIGS["zero2"], "--model_name_or_path", LORA_BASE, *LORA), 1,
                   ("Resume with 2 rank(s) and ZeRO-2",)),
        )),
        row("lora-zero3", "zero3", resume="kill", skips={"export_tool": "adapters/test_lora.py's export tests "
            "(adapter, merged, generate)", "layout": layout}),
        row("lora-zero2+offload_optimizer", "zero2+offload_optimizer"),
        row("lora-zero3+offload_all", "zero3+offload_all"),
        # the reloaded adapter on a freshly quantised base: measured 4.1e-3 from the engine in fp32 (the adapter
        # tensors are DeepSpeed's exactly; where the last bits differ in the 4-bit forward is not pinned down)
        Mode("qlora-zero2", (*CONFIGS["zero2"], "--model_name_or_path", QLORA_BASE, *QLORA), baseline="qlora-zero0",
             says=says, resume="", export_tol=1e-2, skips=qlora_skips, family="qlora"),
    ]  # fmt: skip


def preference_rows() -> list[Mode]:
    """DPO (--objective dpo) against DPO on ZeRO-0: the pairs' shared-prompt rows, the reference computed by each
    row's own engine, the loss averaged over the global batch's pairs."""
    # computed by this layout's engine, whether by the row's run or its resume column's (the same arguments)
    says = ("reference: log-probs of",)
    skips = {
        "resume": "dpo-zero2 (killed) and dpo-zero3 resume a DPO run: the reference file read back, the order kept",
        "export_tool": "tools/export_hf.py converts the ZeRO checkpoint, which the objective does not change",
        "layout": "a DPO checkpoint is a ZeRO checkpoint, converted as the zero rows' are; the reference is a file",
    }

    def row(name, combo, *extra, fragments=(), nproc=2, baseline="dpo-zero0", **kw) -> Mode:
        kw.setdefault("resume", "")
        kw["skips"] = {c: why for c, why in skips.items() if not (c == "resume" and kw["resume"])}
        args = (*CONFIGS[combo], *fragments, *dpo(name), *extra)
        return Mode(name, args, nproc, baseline=baseline, says=says + kw.pop("says", ()), family="dpo", **kw)

    tp = {"fragments": (TENSOR_PARALLEL[2],)}
    return [
        # 2 pairs x 2 accumulation steps per rank: the same 8 pairs a step, averaged over all of them
        row("dpo-zero1", "zero1", *batch(2, 2)),
        row("dpo-zero2", "zero2", resume="kill"),
        row("dpo-zero3", "zero3", resume="step4", says=("model: built under zero.Init",)),
        row("dpo-tp2-zero1", "zero1", *micro(2), **tp, says=("2 ranks = 1 data-parallel x 2 tensor-parallel",)),
        row("dpo-lora-zero2", "zero2", "--model_name_or_path", LORA_BASE, *LORA, baseline="dpo-lora-zero0"),
    ]


# ---- precision: bf16 master weights and optimizer states, torch_autocast ------------------------------------
# The fp32 ZeRO-0 baseline's loss falls by L1 - L8 = 0.859 over the 8 steps (8.3655 -> 7.5060, every step down:
# the sum of its per-step changes), measured. A bf16 rounding of relative size e in each step's update moves that
# step's loss change by at most e x it, so after step t the loss is off by at most e x (L1 - Lt) (a worst case: the
# roundings are summed as if aligned), plus the bf16 forward's own rounding of the loss, which step 1 shows alone,
# before any update (measured 1.5e-4 with bf16 weights, 1.7e-4 under autocast): 2e-4.
BASELINE_DROP, FORWARD_ROUNDING = 0.859, 2e-4
# torch_autocast: fp32 master weights and moments; only the gradients are bf16-computed, 2^-8 relative at most
AUTOCAST_PARITY = 2**-8 * BASELINE_DROP + FORWARD_ROUNDING  # 3.6e-3; measured 3.0e-4
# bf16 master weights and moments: the moments' rounding (2^-9 for m, 2^-10 for sqrt(v): under 2^-8 together) and
# the new master weight's own rounding to bf16, counted as another 2^-8 of the step: e = 2^-7. (That rounding is half
# a bf16 step of the weight, not of the update: where an update is far below a weight's spacing, a norm's 1.0, it
# can be lost whole; over 8 steps of lr 3e-3 it measured within this bound, with 1.6x to spare.)
BF16_STATES_PARITY = 2**-7 * BASELINE_DROP + FORWARD_ROUNDING  # 6.9e-3; measured 4.2e-3
# the gradient norms, relative. Step 1's is one bf16 rounding off (2^-8; measured 2e-4 to 3e-4), but each later norm
# is taken at parameters that drifted by the roundings of the steps before, as the losses did: measured up to 5.3e-3
# (bf16 states, ZeRO-1) and 9.9e-3 (autocast, ZeRO-3, step 5) on a 2-core EPYC, 3.2e-3 on a Xeon. 2^-6 covers that;
# a shard of 2 ranks left out of the norm would move it by about 29 %, one counted twice by about 22 %.
BF16_NORM_PARITY = 2**-6
# autocast's export is the fp32 model it trains; the engine's logits come from its bf16 autocast forward: 2^-8 of the
# largest logit (2.2 after 8 steps, measured) for each of the 4 blocks' outputs and the head's = 4.3e-2; measured
# 1.45e-2 (ZeRO-3) and 8.5e-3 (ZeRO-2 offload). bf16_states exports the bf16 weights the engine computes with: exact.
AUTOCAST_EXPORT_TOL = 5 * 2**-8 * 2.2


def precision_rows() -> list[Mode]:
    """ds_configs/bf16_states.json (bf16 parameters, bf16 master weights and Adam moments) and autocast.json (fp32
    parameters and states, bf16 autocast compute) against the fp32 ZeRO-0 run, within the bf16 bounds above:
    ZeRO-1, 2 and 3 and optimizer offload across the two. What they cost in state bytes, measured in the
    checkpoints against the estimate: tests/integration/training/test_precision_states.py."""
    states, autocast = "ds_configs/bf16_states.json", "ds_configs/autocast.json"
    skips = {
        "export_tool": "tools/export_hf.py converts the ZeRO checkpoint, whose layout the precision does not change "
        "(the master partitions are bf16 or fp32 as in the bf16 and fp32 rows)",
        "layout": "the zero rows' universal conversions: the precision changes the partitions' dtype, not the layout",
    }
    bf16 = {"parity": BF16_STATES_PARITY, "norm_parity": BF16_NORM_PARITY, "family": "precision"}
    amp = {"parity": AUTOCAST_PARITY, "norm_parity": BF16_NORM_PARITY, "export_tol": AUTOCAST_EXPORT_TOL,
           "family": "precision"}  # fmt: skip
    # resumed from a copy of the step-4 checkpoint ("kill" is the zero rows' column: the precision changes what is
    # saved, not when): bit for bit, torch AdamW's bf16 moments, DeepSpeedCPUAdam's and the fp32 ones alike (measured)
    other = {"resume": "autocast-zero3 resumes autocast's fp32 states; the offload path's, bf16_states-zero3+offload_all",
             **skips}  # fmt: skip
    return [
        Mode("bf16_states-zero1", (*CONFIGS["zero1"], states), skips=skips,
             says=("precision: bf16 with bf16 master weights and optimizer states",), **bf16),
        # DeepSpeed builds its DeepSpeedCPUAdam with bf16 moments from the optimizer block the intake adds
        Mode("bf16_states-zero3+offload_all", (*CONFIGS["zero3+offload_all"], states), skips=skips,
             says=("optimizer: DeepSpeed builds its DeepSpeedCPUAdam",), **bf16),
        Mode("autocast-zero2+offload_optimizer", (*CONFIGS["zero2+offload_optimizer"], autocast), resume="",
             skips=other, says=("precision: bf16 autocast, fp32 parameters and master weights",), **amp),
        Mode("autocast-zero3", (*CONFIGS["zero3"], autocast), skips=skips, **amp),
    ]  # fmt: skip


MUON = "ds_configs/muon.json"
# the quick start's model: 4 layers x 7 projections; the embedding, the head and 9 norms take AdamW
MUON_SPLIT = "muon: 28 of 39 tensors (the 2-D non-embedding ones) take Muon, the rest AdamW"


def optimizer_rows() -> list[Mode]:
    """DeepSpeed's Muon (ds_configs/muon.json) on ZeRO-1/2/3 against Muon on ZeRO-0: DeepSpeed orthogonalizes
    each matrix's gradient once a step, on the whole matrix, where ZeRO-1/2 flatten a partition and ZeRO-3 at the
    step. ZeRO-3 accumulates 2 micro-batches of 2: Newton-Schulz once per micro-batch (deepspeed#8443) would
    advance its momentum twice a step, which this parity would see. Which tensors take Muon under zero.Init, the Newton-Schulz
    count and the state bytes are tests/integration/training/test_muon.py's."""
    skips = {
        "export_tool": "tools/export_hf.py reads a ZeRO checkpoint's model states, which the optimizer does not "
        "change (the zero rows' column)",
        "layout": "not offered for Muon: DeepSpeed's universal conversion of its momentum is not checked here",
    }

    def row(name, *args, **kw) -> Mode:
        kw["skips"] = {**skips, **kw.get("skips", {})}
        return Mode(name, args, baseline="muon-zero0", says=(MUON_SPLIT, *kw.pop("says", ())), family="muon", **kw)

    return [
        row("muon-zero1", *CONFIGS["zero1"], MUON, resume="kill"),
        row("muon-zero2", *CONFIGS["zero2"], MUON, resume="", skips={
            "resume": "muon-zero1 (killed) and muon-zero3 resume Muon's states; ZeRO-2 partitions them as ZeRO-1"}),
        row("muon-zero3", *CONFIGS["zero3"], MUON, *batch(2, 2), resume="step4", watch="muon_calls",
            says=("model: built under zero.Init", "zero_optimization.reduce_scatter=false")),
    ]  # fmt: skip


MODES: list[Mode] = [
    *zero_rows(),
    *tensor_parallel_rows(),
    *sequence_parallel_rows(),
    *pipeline_rows(),
    *expert_rows(),
    *adapter_rows(),
    *preference_rows(),
    *precision_rows(),
    *optimizer_rows(),
]
BY_NAME = {m.name: m for m in MODES}


def rows(column: str) -> list[Mode]:
    """The rows that take a column (the others say why in `skips`)."""
    takes = {
        "parity": lambda m: True,
        "resume": lambda m: bool(m.resume),
        "export": lambda m: True,
        "export_tool": lambda m: bool(m.export_tool),
        "layout": lambda m: bool(m.layouts),
    }[column]
    return [m for m in MODES if takes(m)]


def mode_args(args: tuple[str, ...], bases) -> list[str]:
    """train.py's arguments for a row's (or a baseline's, a layout's) fragments and flags, its base models
    named by `bases` (conftest.bases)."""
    named = bases(args)
    return FAST + ["--deepspeed", *(named.get(a, a) for a in args)]
