"""tools/estimate_memory.py --table as a user reads it, in this process: only the GPU counts asked for, 120
columns unless --wide, the precision in the first line, progress while it searches, bad table options refused in
one line. It launches nothing, but its tables take 25 s of tracing, too long for the unit tier's minute. (What
the table recommends, its TP columns and the longest sequence's figures are checked in
tests/integration/memory/test_estimate_memory.py; the time of an 8B table is measured in docs/memory.md, not here.)"""

import json

import pytest

from helpers import SMALL_LLAMA, load_tool, tool_in_process

QUICK = ["--seq_len", "512", "--gpu_memory", "1.12GiB", "--table"]


@pytest.fixture
def config_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", **SMALL_LLAMA, "max_position_embeddings": 4096}))
    return p


def run(*args):
    proc = tool_in_process("estimate_memory", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def every_count(t: dict) -> set:
    return {r["num_gpus"] for key in ("rows", "lora_rows", "tp_rows") for r in t[key]}


def test_only_the_gpu_counts_asked_appear(config_json):
    base = ["--model", config_json, "--deepspeed", "ds_configs/bf16.json", *QUICK]
    t = json.loads(run(*base, "--num_gpus", "8", "--longest_sequence", "false", "--json"))
    assert every_count(t) == {8} and set(t["recommended"]) == {"8"} and t["gpu_counts"] == [8]
    # a cell is the single estimate of that config at that count, not a neighbour's
    cell = next(r for r in t["rows"] if r["config"] == "zero3" and not r["gradient_checkpointing"])
    one = json.loads(run("--model", config_json, "--deepspeed", "ds_configs/zero3.json", "ds_configs/bf16.json",
                         "--seq_len", "512", "--num_gpus", "8", "--json"))  # fmt: skip
    assert cell["peak_bytes"] == one["per_gpu"]["peak_bytes"]
    # --table_gpus adds counts to --num_gpus's, the longest sequence's search included
    t = json.loads(run(*base, "--num_gpus", "8", "--table_gpus", "1,64", "--json"))
    assert every_count(t) == {1, 8, 64} and set(t["recommended"]) <= {"1", "8", "64"}
    assert {r["num_gpus"] for r in t["longest_sequence"]["rows"]} == {1, 8, 64}
    text = run(*base, "--num_gpus", "8", "--longest_sequence", "false").splitlines()
    assert [line.split() for line in text if line.startswith(" " * 24) and "GPU" in line] == [["8", "GPUs"]]
    assert [line.split(":")[0].strip() for line in text if "GPU(s):" in line] == ["8 GPU(s)"]


def test_120_columns_by_default_and_wide_puts_every_count_side_by_side(config_json):
    base = ["--model", config_json, *QUICK, "--longest_sequence", "false"]  # no --num_gpus: 1 to 64 GPUs
    narrow, wide = run(*base).splitlines(), run(*base, "--wide").splitlines()
    assert max(map(len, narrow)) <= 120
    headers = [line.split() for line in narrow if line.startswith("config ")]
    assert [h.count("off") for h in headers] == [4, 3]  # GC off / on for 4 GPU counts, then for the other 3
    (wide_header,) = [line.split() for line in wide if line.startswith("config ")]
    assert wide_header.count("off") == 7 and max(map(len, wide)) > 120
    counts = next(line for line in wide if line.strip().startswith("1 GPU"))
    assert counts.split()[::2] == ["1", "2", "4", "8", "16", "32", "64"]
    # the same cells, the wide lines being the blocks' lines joined
    blocks = {}
    for line in narrow:
        if line.startswith("zero"):
            blocks.setdefault(line.split()[0], []).extend(line.split()[1:])
    assert blocks == {line.split()[0]: line.split()[1:] for line in wide if line.startswith("zero")}
    assert {"zero1", "zero3+offload_all", "zero2+lora16", "zero2+tp2"} <= set(blocks)


def test_the_first_line_states_the_precision(config_json, tmp_path):
    first = run("--model", config_json, *QUICK, "--num_gpus", "2", "--longest_sequence", "false").splitlines()
    assert first[0].startswith("precision: fp32 assumed") and "add ds_configs/bf16.json" in first[0]
    assert not any(line.startswith("note: precision") for line in first)  # said once, first
    bf16 = run("--model", config_json, "--deepspeed", "ds_configs/bf16.json", *QUICK, "--num_gpus", "2",
               "--longest_sequence", "false")  # fmt: skip
    assert bf16.splitlines()[0] == "precision: bf16 (set by ds_configs/bf16.json)"
    # a config.json saying bfloat16 is the likeliest reason to expect bf16: the line says why it is not
    stored = tmp_path / "bf16-weights.json"
    stored.write_text(json.dumps({**json.loads(config_json.read_text()), "torch_dtype": "bfloat16"}))
    line = run("--model", stored, *QUICK, "--num_gpus", "2", "--longest_sequence", "false").splitlines()[:2]
    assert line[0].startswith("precision: fp32 assumed") and "torch_dtype bfloat16" in " ".join(line)


def test_progress_while_it_searches_and_the_table_before_the_search(config_json):
    """The slow part (the longest sequence's search) reports each length it tries; the grid is handed over first,
    so the CLI prints it while the search runs. On a terminal the CLI draws these on one line of stderr."""
    tool = load_tool("estimate_memory")
    argv = ["--model", str(config_json), "--deepspeed", "ds_configs/bf16.json", *QUICK, "--num_gpus", "4"]
    args = tool.parser().parse_args(argv)
    tool.check_args(args)
    heard = []
    from zero_recipes.memory.from_args import loader
    from zero_recipes.memory.table import table

    t = table(args, int(1.12 * 2**30), loader(), *args.table_counts, heard.append, lambda t: heard.append("grid"))
    searched = [h for h in heard if h.startswith("longest sequence on 4 GPU(s)")]
    assert heard.index("grid") < heard.index(searched[0]) and searched[-1].endswith(" tokens")
    found = {r["gradient_checkpointing"]: r["seq_len"] for r in t["longest_sequence"]["rows"]}
    assert f"{found[True]:,} tokens" in " ".join(searched)  # the answer was one of the lengths tried

    class Terminal:
        text = ""

        def isatty(self):
            return True

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    screen = Terminal()
    show = tool.status_line(screen)
    show("longest sequence on 8 GPU(s), checkpointing on: trying 393,216 tokens")
    show(None)
    assert "\r\033[K[   0 s] longest sequence on 8 GPU(s)" in screen.text and screen.text.endswith("\r\033[K")


@pytest.mark.parametrize(
    "args,words",
    [
        (["--table", "--gpu_memory", "1GiB", "--table_gpus", "0,8"], "--table_gpus takes GPU counts per node"),
        (["--table", "--gpu_memory", "1GiB", "--table_gpus", "eight"], "like 1,8,64 (each >= 1), or all"),
        (["--wide"], "--table_gpus and --wide shape the table; add --table"),
    ],
)
def test_bad_table_options_are_one_line(config_json, args, words):
    proc = tool_in_process("estimate_memory", "--model", config_json, "--deepspeed", "ds_configs/zero2.json", *args)
    lines = [x for x in proc.stderr.splitlines() if x.strip() and "WARNING" not in x]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], lines
