"""tools/plot_metrics.py and tools/generate.py on one real tiny train.py run (1 process, 8 steps, eval
every 4): the plots compare it with a second, resumed run on one chart per metric; generation samples from
its export; bad input gets one `error:` line and exit 2."""

import json
import math
import shutil
import struct
import subprocess
import sys

import pytest

from helpers import FAST, REPO, launch, load_tool, tool_in_process

generate, plot_metrics = load_tool("generate"), load_tool("plot_metrics")

CHARTS = ["loss", "eval_loss", "eval_exact_match", "lr", "grad_norm", "tokens_per_sec", "memory"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "run"
    # one thread: on a busy 2-core machine two threads for this tiny model take 3x longer (measured 23 s vs 8 s)
    return launch(
        FAST + ["--eval_steps", "4", "--deepspeed", "ds_configs/zero2.json"],
        out,
        nproc=1,
        launcher="python",
        env={"OMP_NUM_THREADS": "1"},
    ).check()


def resumed_run(path):
    """An SFT run on a GPU, its metrics.jsonl as an older train.py left it after a resume: launch 1 logged
    steps 1-6 and died, launch 2 resumed from the step-3 checkpoint and logged steps 4-8 again."""

    def record(step, loss):
        return {
            "step": step,
            "epoch": step / 100,
            "loss": loss,
            "lr": 1e-3 * step / 8,
            "grad_norm": 2.0 / step,
            "tokens_per_sec": 8000.0,
            "tokens_per_sec_per_device": 1000.0,
            "mfu": 0.4,
            "data_wait_frac": 0.01,
            "mem_allocated_gb": 1.5,
            "mem_peak_gb": 2.5,
            "cpu_rss_gb": 3.0,
        }

    def evaluation(step, loss, exact):
        return {"step": step, "eval_loss": loss, "eval_perplexity": math.exp(loss), "eval_exact_match": exact}

    lines = [record(s, 9.0 - 0.1 * s) for s in range(1, 7)] + [evaluation(4, 8.7, 0.0)]
    lines += [record(s, 8.0 - 0.1 * s) for s in range(4, 9)] + [evaluation(8, 7.5, 0.25)]
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def tool(name, *args):
    return subprocess.run(
        [sys.executable, f"tools/{name}", *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def one_error_line(proc, *fragments) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_two_runs_share_one_chart_per_metric(run, tmp_path):
    other = resumed_run(tmp_path / "gpu" / "run")  # same directory name as the real run: labels must differ
    proc = tool("plot_metrics.py", run.output_dir, other, "--out", tmp_path / "plots", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    *paths, summary = proc.stdout.splitlines()
    summary = json.loads(summary)
    assert list(summary) == CHARTS and paths == [str(tmp_path / "plots" / f"{c}.png") for c in CHARTS]
    for chart in CHARTS:
        data = (tmp_path / "plots" / f"{chart}.png").read_bytes()
        width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
        assert data[:8] == PNG and 600 <= width <= 2000 and 300 <= height <= 1500 and len(data) > 10_000, chart
    real = f"{run.output_dir.parent.name}/run"
    assert summary["loss"]["series"] == [f"{real} train", f"{real} eval", "gpu/run train", "gpu/run eval"]
    for chart in ("eval_loss", "lr", "grad_norm", "tokens_per_sec"):
        assert summary[chart]["series"] == [real, "gpu/run"], chart
    assert summary["eval_exact_match"]["series"] == ["gpu/run"]  # the text run has no exact match
    assert summary["loss"]["title"].endswith(": 2 runs") and summary["eval_exact_match"]["title"].endswith(": gpu/run")
    assert "skipped" not in proc.stderr
    assert summary["memory"]["series"] == [
        f"{real}: CPU RSS",
        "gpu/run: GPU max allocated",
        "gpu/run: GPU allocated",
        "gpu/run: CPU RSS",
    ]
    # the resumed run: one point per step, the resumed launch's value where the steps were logged twice
    series = plot_metrics.read_run(other)
    assert series["loss"] == {**{s: 9.0 - 0.1 * s for s in (1, 2, 3)}, **{s: 8.0 - 0.1 * s for s in range(4, 9)}}
    assert series["eval_loss"] == {4: 8.7, 8: 7.5}
    # the real run logged what the loss chart draws
    real_series = plot_metrics.read_run(run.output_dir)
    assert sorted(real_series["loss"]) == list(range(1, 9)) and sorted(real_series["eval_loss"]) == [4, 8]


def test_default_out_is_the_first_runs_plots_folder(tmp_path, capsys):
    only = resumed_run(tmp_path / "a")
    assert plot_metrics.main([str(only)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(only / "plots" / f"{c}.png") for c in CHARTS]


def test_plot_bad_input(tmp_path, capsys):
    (tmp_path / "nometrics").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    broken = resumed_run(tmp_path / "broken")
    with open(broken / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "loss": 7.1, "lr"\n')  # a launch killed mid-write
    (tmp_path / "afile").write_text("")
    one_error_line(tool("plot_metrics.py", tmp_path / "missing"), "is not a directory")
    for args, fragments in [
        ([tmp_path / "nometrics"], ["metrics.jsonl does not exist", "--output_dir"]),
        ([tmp_path / "empty"], ["holds no records"]),
        ([broken], ["metrics.jsonl:14:", "delete or fix that line"]),
        ([resumed_run(tmp_path / "ok"), "--out", tmp_path / "afile"], ["cannot write", "--out"]),
    ]:
        assert plot_metrics.main([str(a) for a in args]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and all(f in err[0] for f in fragments), err


def test_generate_greedy_is_deterministic_and_uses_the_chat_template(run, tmp_path, capsys):
    args = [run.output_dir, "Return the number of", "--temperature", "0", "--max_new_tokens", "12", "--show_prompt"]
    proc = tool("generate.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout) > 1, "greedy decoding generated nothing"  # after 8 steps it may be all newlines
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run.output_dir)
    if tok.chat_template:  # a text run's tokenizer has none today; with one, the template must be used
        assert "prompt (chat template, " in proc.stderr and "Return the number of" in proc.stderr
    else:
        assert "prompt (raw text, " in proc.stderr and "\nReturn the number of\n--- end of prompt" in proc.stderr
    assert generate.main([str(a) for a in args]) == 0  # in this process: the same text
    assert capsys.readouterr().out == proc.stdout
    sampled = [str(run.output_dir), "Return the number of", "--max_new_tokens", "12", "--seed", "3"]
    samples = []
    for _ in range(2):
        assert generate.main(sampled) == 0
        samples.append(capsys.readouterr().out)
    assert samples[0] == samples[1], "one seed, one sample"

    # an SFT-style export: the same model, its tokenizer saved with the default chat template SFT runs save
    from zero_recipes.data.formats import DEFAULT_CHAT_TEMPLATE

    chat = tmp_path / "chat"
    chat.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy2(run.output_dir / f, chat / f)
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    tok.save_pretrained(chat)
    question = [str(chat), "What is 2 plus 3?", "--temperature", "0", "--max_new_tokens", "8", "--show_prompt"]
    assert generate.main(question) == 0
    err = capsys.readouterr().err
    assert "prompt (chat template, " in err
    assert "\n<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n\n--- end of prompt" in err
    assert generate.main(question + ["--no_chat_template"]) == 0
    err = capsys.readouterr().err
    assert "prompt (raw text, " in err and " tokens):\nWhat is 2 plus 3?\n--- end of prompt" in err


def test_generate_bad_input(run, tmp_path):
    """The first case as a real process (the shell sees one line and exit 2), the others in this process."""
    interrupted = tmp_path / "interrupted"
    shutil.copytree(run.output_dir / "checkpoints", interrupted / "checkpoints")  # stopped before its export
    one_error_line(
        tool("generate.py", interrupted, "hi"),
        "no exported model",
        f"python tools/export_hf.py {interrupted} {interrupted}-hf",
    )
    step = interrupted / "checkpoints" / "step-8"
    one_error_line(
        tool_in_process("generate", step, "hi"),
        "no exported model",
        f"python tools/export_hf.py {step} {interrupted}-hf",
    )
    one_error_line(tool_in_process("generate", tmp_path / "missing", "hi"), "is not a directory")
    (tmp_path / "empty").mkdir()
    one_error_line(tool_in_process("generate", tmp_path / "empty", "hi"), "holds no HF model")
    one_error_line(tool_in_process("generate", run.output_dir, "hi", "--temperature", "-1"), "--temperature >= 0")
