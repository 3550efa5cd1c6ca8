"""The bad-input catalogue: every mistake a user was seen to make, one row each. Every row must end in exit 2
with one `error:` line naming the problem and the fix, no traceback, and nothing of the user's changed:
the files a row plants (its "user's files") are checksummed before and after, and nothing new appears.

Rows run where their refusal happens. Refusals before any process group run in this process
(helpers.refusal: train.main raises the ConfigError that the entry point prints with exit 2); one row per
family runs as a real process or under the real launcher, to prove the line and the code reach the shell.
A refusal that needs prepared data, a rendezvous or a checkpoint runs as a process too."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass, field

import pytest

from helpers import REPO, dry_run_in_process, file_tree, free_port, refusal, run_train, tool_in_process, train_args

ZERO2 = ("--deepspeed", "ds_configs/zero2.json")
TINY_VOCAB = (
    '{"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, '
    '"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}'
)

PP2 = "ds_configs/pp2.json"
ONE_LAYER = (
    '{"model_type": "llama", "vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64, '
    '"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}'
)
GPT2 = '{"model_type": "gpt2", "vocab_size": 4096, "n_embd": 32, "n_layer": 2, "n_head": 4}'
EP2 = "ds_configs/ep2.json"


def moe_config(model_type: str = "mixtral", **fields) -> str:
    """A tiny mixture of experts of `model_type` (Mixtral's fields unless given)."""
    import json

    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 4096}
    shape |= {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2}
    return json.dumps({"model_type": model_type, "num_local_experts": 4, **shape, **fields})


@dataclass
class Case:
    name: str
    args: tuple  # train.py's arguments; "{tmp}" is the row's own folder, "{port}" a port held by another job
    says: tuple  # fragments the error line must hold
    files: dict = field(default_factory=dict)  # the user's files: path under {tmp} -> text or bytes ("/": a folder)
    runner: str = "in-process"  # or "process" (python train.py), "launcher" (deepspeed --num_gpus 1), or a tool

    damaged_run: bool = False  # {tmp}/run is a copy of a finished ZeRO-2 run, each checkpoint cut short


CASES = [
    # ---- configs and options -------------------------------------------------------------------------
    Case("missing ds config", ("--deepspeed", "ds_configs/zero9.json", "--dry_run"),
         ("'ds_configs/zero9.json' not found", "zero3.json"), runner="process"),
    Case("malformed ds config", ("--deepspeed", "{tmp}/bad.json", "--dry_run"), ("bad.json:3:", "invalid JSON"),
         files={"bad.json": '{\n  "train_batch_size": "auto",\n  "zero_optimization": {"stage": 2,,}\n}\n'}),
    Case("ds config path is a directory", ("--deepspeed", "ds_configs", "--dry_run"),
         ("--deepspeed ds_configs is a directory", "zero3.json")),
    Case("no ds config", ("--max_steps", "1"), ("--deepspeed ds_configs/zero3.json",)),
    Case("unknown recipe key", ("--recipe", "{tmp}/r.yaml", *ZERO2, "--dry_run"),
         ("unknown option 'learning_rat'", "did you mean 'learning_rate'"), files={"r.yaml": "learning_rat: 1.0e-4\n"}),
    Case("batch arithmetic", ("--deepspeed", "{tmp}/ds.json", "--per_device_train_batch_size", "4", "--dry_run"),
         ("train_batch_size=48", "micro 4 x accumulation 1 x data-parallel 2 = 8"),
         files={"ds.json": '{"train_batch_size": 48, "train_micro_batch_size_per_gpu": "auto", '
                           '"gradient_accumulation_steps": "auto"}'}),
    Case("bf16 and fp16 flags", (*ZERO2, "--bf16", "--fp16", "--dry_run"), ("bf16 and fp16 are both on",)),
    Case("bf16 and fp16 blocks", (*ZERO2, "{tmp}/both.json", "--dry_run"), ("bf16 and fp16 are both enabled",),
         files={"both.json": '{"bf16": {"enabled": true}, "fp16": {"enabled": true}}'}),
    Case("flash_attention_2 without flash-attn, dry run", ("--attn_implementation", "flash_attention_2", "--dry_run"),
         ("flash_attention_2 cannot be used", "--attn_implementation sdpa")),
    Case("tf32 on a CPU", (*ZERO2, "--tf32", "true"), ("--tf32 needs an NVIDIA GPU", "drop --tf32")),
    Case("flex_attention on a CPU", ("--attn_implementation", "flex_attention", "--dry_run"),
         ("flex_attention cannot train on cpu",)),
    Case("block size above max positions", (*ZERO2, "--block_size", "4096", "--dry_run"),
         ("block_size 4096 exceeds the model's max_position_embeddings 1024",)),
    Case("nvme path missing", ("--deepspeed", "ds_configs/zero3.json", "ds_configs/nvme.json",
                               "--nvme_path", "{tmp}/nvme"),
         ("nvme_path", "does not exist; create it on the NVMe drive")),
    # ---- GPU-only knobs on a CPU, and the pairs DeepSpeed forbids: refused before any process group ------
    Case("ZenFlow on a CPU", (*ZERO2, "ds_configs/zenflow.json", "--dry_run"),
         ("ZenFlow (zero_optimization.zenflow) needs CUDA GPUs", "use ds_configs/offload_optimizer.json")),
    Case("SuperOffload on a CPU", ("--deepspeed", "ds_configs/zero3.json", "ds_configs/superoffload.json", "--dry_run"),
         ("SuperOffload (offload_optimizer.super_offload) needs NVIDIA CUDA GPUs", "use ds_configs/offload_optimizer")),
    Case("DeepCompile on a CPU", ("--deepspeed", "ds_configs/zero3.json", "ds_configs/deepcompile.json", "--max_steps",
                                  "1"),
         ("DeepCompile (compile.deepcompile) needs CUDA GPUs", "drop ds_configs/deepcompile.json")),
    Case("activation offload on a CPU", ("--deepspeed", "ds_configs/zero3.json", "ds_configs/offload_activations.json",
                                         "--dry_run"),
         ("compile.offload_activation) needs CUDA GPUs", "--gradient_checkpointing true")),
    Case("Lion without optimizer offload on a CPU", (*ZERO2, "{tmp}/lion.json", "--dry_run"),
         ("the Lion optimizer on this CPU needs optimizer offload", "ds_configs/offload_optimizer.json"),
         files={"lion.json": '{"optimizer": {"type": "Lion", "params": {"lr": "auto", "weight_decay": "auto"}}}'}),
    Case("ZenFlow's update interval left to DeepSpeed", (*ZERO2, "ds_configs/offload_optimizer.json", "{tmp}/zf.json"),
         ('zenflow.update_interval = \'auto\'', "give it a whole number"),
         files={"zf.json": '{"zero_optimization": {"zenflow": {"topk_ratio": 0.05, "update_interval": "auto"}}}'}),
    Case("AutoEP with ZeRO-3 and qgZ", ("--deepspeed", "ds_configs/zero3.json", EP2, "{tmp}/qgz.json"),
         ("expert_parallel (AutoEP) with ZeRO-3 and zero_quantized_gradients (qgZ)", "zero2.json"),
         files={"qgz.json": '{"zero_optimization": {"zero_quantized_gradients": true}}'}),
    Case("Muon with qgZ", ("--deepspeed", "ds_configs/zero3.json", "ds_configs/muon.json", "{tmp}/qgz.json"),
         ("zero_quantized_gradients (qgZ) with the Muon optimizer", "use AdamW"),
         files={"qgz.json": '{"zero_optimization": {"zero_quantized_gradients": true}}'}),
    # ---- pipeline parallelism: every refusal before any process group --------------------------------
    Case("pipeline with ZeRO-2", ("--deepspeed", "ds_configs/zero2.json", PP2, "--dry_run"),
         ("pipeline.stages = 2 with ZeRO-2", "ds_configs/zero1.json")),
    Case("pipeline with ZeRO-3", ("--deepspeed", "ds_configs/zero3.json", PP2, "--max_steps", "1"),
         ("pipeline.stages = 2 with ZeRO-3", "ds_configs/zero1.json")),
    Case("pipeline with tensor parallelism", ("--deepspeed", "ds_configs/zero1.json", "ds_configs/tp2.json", PP2),
         ("pipeline.stages = 2 with tensor_parallel.autotp_size = 2", "use one of them")),
    Case("pipeline with sequence parallelism", ("--deepspeed", "ds_configs/zero1.json", "ds_configs/sp2.json", PP2),
         ("pipeline.stages = 2 with sequence_parallel_size = 2", "use one of them")),
    Case("more stages than layers", ("--deepspeed", "ds_configs/zero1.json", PP2, "--model_config", ONE_LAYER),
         ("pipeline.stages = 2 exceeds the model's 1 decoder layers", "use at most 1 stages")),
    Case("world not divisible by the stages", ("--deepspeed", "ds_configs/zero1.json", "ds_configs/pp4.json"),
         ("2 rank(s) cannot split into pipeline-parallel groups of 4", "pick a stage count that divides")),
    Case("a family that cannot be split", ("--deepspeed", "ds_configs/zero1.json", PP2, "--model_config", GPT2),
         ("model type 'gpt2' cannot be split into pipeline stages", "ds_configs/zero3.json")),
    Case("pipeline partition unknown", ("--deepspeed", "ds_configs/zero1.json", "{tmp}/pp.json"),
         ("pipeline.partition = 'balanced' is not a way to split layers", '"uniform"'),
         files={"pp.json": '{"pipeline": {"stages": 2, "partition": "balanced"}}'}),
    Case("pipeline partition by a type no layer has", ("--deepspeed", "ds_configs/zero1.json", "{tmp}/pp.json"),
         ("pipeline.partition = 'type:Transformer' matches no layer", "Block", '"parameters"'),
         files={"pp.json": '{"pipeline": {"stages": 2, "partition": "type:Transformer"}}'}),
    Case("pipeline with DeepSpeed's wall-clock timers", ("--deepspeed", "ds_configs/zero1.json", "{tmp}/pp.json"),
         ("wall_clock_breakdown = true with pipeline.stages", "set it false"),
         files={"pp.json": '{"pipeline": {"stages": 2}, "wall_clock_breakdown": true}'}),
    # ---- mixtures of experts and expert parallelism ---------------------------------------------------
    Case("expert parallelism on a dense model", (*ZERO2, EP2, "--dry_run"),
         ("model type 'llama' has no experts to split", "remove the ep fragment")),
    Case("expert parallelism not dividing the experts", (*ZERO2, EP2, "--model_config", moe_config(num_local_experts=3)),
         ("autoep_size = 2 does not divide the model's 3 experts",)),
    Case("expert parallelism not dividing the world", (*ZERO2, "ds_configs/ep4.json", "--model_config", moe_config()),
         ("2 rank(s) cannot split into expert-parallel groups of 4", "pick an autoep_size that divides")),
    Case("expert parallelism with tensor parallelism", ("--deepspeed", "ds_configs/zero1.json", "ds_configs/tp2.json",
                                                        EP2, "--model_config", moe_config()),
         ("expert_parallel.autoep_size = 2 with tensor_parallel.autotp_size = 2", "use one of them")),
    Case("expert parallelism for a family AutoEP has no preset for",
         (*ZERO2, EP2, "--model_config", moe_config("olmoe", num_experts=4)),
         ("AutoEP has no preset for model type 'olmoe'", "without the ep fragment")),
    Case("an unknown mixture of experts under ZeRO-3",
         ("--deepspeed", "ds_configs/zero3.json", "--model_config", moe_config("phimoe")),
         ("'phimoe' is a mixture of experts this project does not know", '"leaf_module"', "zero2.json")),
    Case("more experts per token than experts", (*ZERO2, "--model_config", moe_config(num_experts_per_tok=5)),
         ("num_experts_per_tok = 5 is greater than the 4 experts", "at most 4")),
    Case("pipeline seed_layers", ("--deepspeed", "ds_configs/zero1.json", "{tmp}/pp.json"),
         ("pipeline.seed_layers = true", "remove seed_layers"),
         files={"pp.json": '{"pipeline": {"stages": 2, "seed_layers": true}}'}),
    # ---- data ----------------------------------------------------------------------------------------
    Case("missing dataset file", (*ZERO2, "--dataset_name", "{tmp}/nope.jsonl"), ("does not exist",)),
    Case("missing dataset file, dry run", ("--dataset_name", "{tmp}/nope.jsonl", "--dry_run"), ("does not exist",)),
    Case("bad JSON lines", (*ZERO2, "--dataset_name", "{tmp}/bad.jsonl"),
         ("bad.jsonl:2:1: not valid JSON lines",), files={"bad.jsonl": '{"text": "a"}\nnot json\n'}, runner="process"),
    Case("model vocab smaller than the tokenizer",
         ("--model_config", TINY_VOCAB, *ZERO2, "--max_steps", "1", "--block_size", "32", "--report_to", "none"),
         ("tokenizer has 4096 tokens but the model's vocab_size is 100",), runner="process"),
    Case("near dedupe while streaming", (*ZERO2, "--streaming", "--max_steps", "2", "--dedupe", "near"),
         ("--dedupe near needs the whole dataset", "tools/clean_data.py")),
    Case("an unknown dedupe mode", (*ZERO2, "--dedupe", "fuzzy"), ("--dedupe 'fuzzy' is not one of none, exact, near",)),
    Case("a dedupe threshold outside (0, 1)", (*ZERO2, "--dedupe", "near", "--dedupe_threshold", "70"),
         ("--dedupe_threshold must be between 0 and 1 (exclusive), got 70.0",)),
    Case("the quality filter on SFT data", (*ZERO2, "--dataset_name", "builtin:tiny-instructions", "--quality_filter",
                                            "gopher"),
         ("--quality_filter gopher judges web documents", "use --drop_garbled and --dedupe for SFT data"),
         runner="process"),
    Case("--eval_tasks under sequence parallelism", ("--deepspeed", "ds_configs/zero3.json", "ds_configs/sp2.json",
                                                     "--eval_tasks", "docstring_cloze"),
         ("--eval_tasks cannot run on this run's live model", "Ulysses", "python tools/evaluate.py")),
    Case("--eval_samples under pipeline parallelism", ("--deepspeed", "ds_configs/zero1.json", PP2, "--eval_samples",
                                                       "4"),
         ("--eval_samples cannot run on this run's live model", "stage", "python tools/evaluate.py")),
    Case("--eval_tasks with a misspelt task", (*ZERO2, "--eval_tasks", "hellaswg"),
         ("lm-eval does not know the task 'hellaswg'", "close names: hellaswag")),
    # ---- tools/evaluate.py: nothing written, nothing loaded before the inputs are checked ----------------
    Case("evaluate a directory that is not a model", ("{tmp}/m", "--tasks", "docstring_cloze"),
         ("holds no HF model", "tools/export_hf.py"), files={"m/notes.txt": "mine"}, runner="evaluate"),
    Case("evaluate a task YAML that does not parse", ("{tmp}/m", "--tasks", "{tmp}/t.yaml"),
         ("t.yaml does not parse as YAML",), files={"t.yaml": "task: [mine\n"}, runner="evaluate"),
    Case("evaluate a task YAML without a key", ("{tmp}/m", "--tasks", "{tmp}/t.yaml"),
         ("t.yaml lacks the key 'doc_to_target'", "new_task_guide.md"),
         files={"t.yaml": "task: mine\ndataset_path: json\noutput_type: generate_until\ndoc_to_text: '{{q}}'\n"},
         runner="evaluate"),
    Case("evaluate prompts that are not JSON lines", ("{tmp}/m", "--samples", "{tmp}/p.jsonl"),
         ("p.jsonl:2",), files={"p.jsonl": '{"prompt": "hi"}\nnot json\n'}, runner="evaluate"),
    # ---- tools/clean_data.py: nothing written, the input untouched -------------------------------------
    Case("clean_data of a binary file", ("{tmp}/blob.jsonl", "--output", "{tmp}/out.jsonl"),
         ("blob.jsonl is a binary file", "UTF-8 .jsonl"), files={"blob.jsonl": b"\x7fELF\x02\x01\x00\x00" * 64},
         runner="clean_data"),
    Case("clean_data of a line that is not JSON", ("{tmp}/bad.jsonl", "--output", "{tmp}/out.jsonl"),
         ("bad.jsonl:2:1: not valid JSON lines",), files={"bad.jsonl": '{"text": "a"}\nnot json\n'},
         runner="clean_data"),
    Case("clean_data without the text column", ("{tmp}/cols.jsonl", "--output", "{tmp}/out.jsonl"),
         ("has no column 'text' (columns: body, id)", "--text_column NAME"),
         files={"cols.jsonl": '{"body": "a", "id": 1}\n'}, runner="clean_data"),
    Case("clean_data with a threshold outside (0, 1)", ("{tmp}/a.jsonl", "--output", "{tmp}/out.jsonl", "--dedupe",
                                                        "near", "--dedupe_threshold", "0"),
         ("--dedupe_threshold must be between 0 and 1",), files={"a.jsonl": '{"text": "a"}\n'}, runner="clean_data"),
    Case("clean_data onto its own input", ("{tmp}/a.jsonl", "--output", "{tmp}/a.jsonl"),
         ("would overwrite the input", "write it elsewhere"), files={"a.jsonl": '{"text": "a"}\n'},
         runner="clean_data"),
    Case("clean_data on executors with no tasks", ("{tmp}/a.jsonl", "--output", "{tmp}/out", "--executor", "local",
                                                   "--tasks", "0"),
         ("--tasks must be at least 1, got 0",), files={"a.jsonl": '{"text": "a"}\n'}, runner="clean_data"),
    Case("clean_data into a directory of someone's files", ("{tmp}/a.jsonl", "--output", "{tmp}/out", "--executor",
                                                            "local"),
         ("/out already holds files of something else", "name a new directory"),
         files={"a.jsonl": '{"text": "a"}\n', "out/00000.jsonl": '{"text": "theirs"}\n'}, runner="clean_data"),
    Case("clean_data --tasks without an executor", ("{tmp}/a.jsonl", "--output", "{tmp}/o.jsonl", "--tasks", "4"),
         ("--tasks sets how datatrove's executors run; add --executor local|ray|slurm",),
         files={"a.jsonl": '{"text": "a"}\n'}, runner="clean_data"),
    # ---- output_dir: nothing of the user's replaced or removed ---------------------------------------
    Case("output dir holds the user's files", (*ZERO2, "--output_dir", "{tmp}/mine"),
         ("holds no zero-recipes run", "--overwrite_output_dir"), files={"mine/thesis.txt": "precious"}),
    Case("overwrite onto a user's config.json", (*ZERO2, "--output_dir", "{tmp}/mydir", "--overwrite_output_dir"),
         ("did not write under names its run and export write: config.json;",),
         files={"mydir/config.json": '{"a":1}', "mydir/notes.txt": "notes"}),
    Case("output dir is a file", (*ZERO2, "--output_dir", "{tmp}/notes.txt"), ("notes.txt is a file, not a directory",),
         files={"notes.txt": "the user's file"}),
    # sysfs refuses new files even to root, as a read-only mount does
    Case("output dir not writable", (*ZERO2, "--output_dir", "/sys/zero-recipes-run"),
         ("cannot write in /sys", "point --output_dir elsewhere")),
    # ---- damaged checkpoints: a resume passes over a damaged one; with none intact it is refused --------
    Case("every checkpoint damaged, relaunched", ("--output_dir", "{tmp}/run"),
         ("no intact checkpoint to resume from", "(truncated)", "--overwrite_output_dir"), damaged_run=True),
    Case("a damaged checkpoint named by the user", ("--output_dir", "{tmp}/run", "--resume_from_checkpoint",
                                                    "{tmp}/run/checkpoints/step-8"),
         ("step-8 is damaged", "(truncated)"), damaged_run=True),
    Case("export_hf of a damaged checkpoint", ("{tmp}/run/checkpoints/step-8", "{tmp}/exported"),
         ("step-8 is damaged", "(truncated)"), damaged_run=True, runner="export_hf"),
    # ---- the memory estimator's table ----------------------------------------------------------------
    Case("estimator table without a GPU size", ("--model", "recipes/configs/llama-3.1-8b.json", "--num_gpus", "8",
                                                "--table"),
         ("--table needs --gpu_memory",), runner="estimate_memory"),
    Case("estimator table with bad GPU counts", ("--model", "recipes/configs/llama-3.1-8b.json", "--table",
                                                 "--gpu_memory", "80GiB", "--table_gpus", "1,x"),
         ("--table_gpus takes GPU counts per node like 1,8,64",), runner="estimate_memory"),
    # ---- launching -----------------------------------------------------------------------------------
    Case("rendezvous port held by another job", (*ZERO2, "--max_steps", "1"),
         ("the rendezvous address 127.0.0.1:{port} is already in use (another job on this machine?)",
          "deepspeed --master_port N", "torchrun --master-port N"), runner="launcher"),
]  # fmt: skip


def error_line(case: Case, args: list[str], port: int) -> str:
    if case.runner == "in-process":
        return refusal(*args, world=2)  # rank 0 of 2: the refusal must come before any rank waits
    if case.runner in ("export_hf", "estimate_memory", "clean_data", "evaluate"):
        proc = tool_in_process(case.runner, *args)
    elif case.runner == "process":
        proc = run_train(*args)
    else:
        cmd = ["deepspeed", "--num_gpus", "1", "--master_port", str(port), "train.py", *args]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]  # after any progress bars
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def damaged_copy(run, dest):
    """A copy of a finished run whose every checkpoint has its rank-0 optimizer file cut to half; the args
    it was launched with (relaunching "the same command")."""
    shutil.copytree(run.output_dir, dest)
    for step in (dest / "checkpoints").glob("step-*"):
        shard = step / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        os.truncate(shard, shard.stat().st_size // 2)
    return train_args(run)


def flash_attn_installed() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()


def on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def on_cuda() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cuda"


# rows that are bad input only where the machine lacks what they ask for
WHERE = {"flash_attention_2": (flash_attn_installed, "flash-attn is installed"),
         "flex_attention": (lambda: not on_cpu(), "flex_attention trains on this accelerator"),
         **dict.fromkeys(("ds_configs/zenflow.json", "ds_configs/superoffload.json", "ds_configs/deepcompile.json",
                          "ds_configs/offload_activations.json"), (on_cuda, "a CUDA GPU runs it")),
         "{tmp}/lion.json": (lambda: not on_cpu(), "this accelerator has FusedLion")}  # fmt: skip
ROWS = [
    pytest.param(
        c, id=c.name, marks=[pytest.mark.skipif(WHERE[a][0](), reason=WHERE[a][1]) for a in c.args if a in WHERE]
    )
    for c in CASES
]


@pytest.mark.parametrize("case", ROWS)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case, tmp_path, trained):
    for rel, text in case.files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith("/"):
            path.mkdir()
        else:
            path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    port = free_port()
    args = [a.replace("{tmp}", str(tmp_path)).replace("{port}", str(port)) for a in case.args]
    if case.damaged_run:
        launched = damaged_copy(trained("zero2", "fp32").check(), tmp_path / "run")
        args = args if case.runner == "export_hf" else launched + args
    if "--output_dir" not in args and case.runner in ("in-process", "process", "launcher"):
        args += ["--output_dir", str(tmp_path / "run")]  # never the repository's outputs/
    before = file_tree(tmp_path)
    if case.runner == "launcher":
        with socket.socket() as held:  # another job's rendezvous on this machine
            held.bind(("127.0.0.1", port))
            held.listen()
            line = error_line(case, args, port)
    else:
        line = error_line(case, args, port)
    assert line.startswith("error: ") and "\n" not in line
    for fragment in case.says:
        assert fragment.replace("{port}", str(port)) in line, line
    assert file_tree(tmp_path) == before  # byte for byte, and nothing created (no output dir, no cache)


def test_dry_run_warns_what_this_machine_cannot_train(tmp_path):
    nvme = tmp_path / "nvme"
    out = dry_run_in_process("--deepspeed", "ds_configs/zero3.json", "ds_configs/nvme.json", "--nvme_path", str(nvme))
    assert f"warning: this machine cannot train it: nvme_path {nvme} does not exist" in out
    assert not nvme.exists()
