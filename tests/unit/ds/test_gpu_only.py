"""The GPU-only fragments (ds_configs/zenflow.json, superoffload.json, deepcompile.json, offload_activations.json)
through the intake (ds/gpu_only.py), in this process: each resolves to a config DeepSpeed's own models accept, as a
GPU would run it (the resolution is pure; the machine is asked separately, by machine_problems); each is refused
on a CPU in one line naming what it needs and the alternative; what DeepSpeed 0.19.8 rejects or ignores with them
is refused in one line on any machine; other tools' spellings land where DeepSpeed reads them. Also Lion without
optimizer offload on a CPU, and the pairs DeepSpeed forbids: AutoEP with ZeRO-3 and hpZ/qgZ, Muon with qgZ."""

import pytest

from zero_recipes.config.cli import parse_args
from zero_recipes.config.train_config import ConfigError
from zero_recipes.ds import checks, gpu_only
from zero_recipes.ds.intake import load_fragments, resolve, with_steps


def resolved(*fragments: str, argv=(), zero: dict | None = None, extra: dict | None = None):
    """(ds, notes, adopted config) of ds_configs/FRAGMENTS merged, `zero` merged into zero_optimization and `extra`
    over the top level, 2 ranks: what train.py resolves before it asks the machine anything."""
    paths = [f"ds_configs/{f}" for f in fragments]
    cfg, explicit = parse_args([*argv, "--deepspeed", *paths])
    raw = load_fragments(paths)
    raw.setdefault("zero_optimization", {}).update(zero or {})
    for key, value in (extra or {}).items():
        raw[key] = (
            {**raw.get(key, {}), **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
        )
    r = resolve(raw, cfg, explicit, world_size=2, hidden_size=64)
    return with_steps(r.ds, r.cfg, 10), r.notes, r.cfg


def refused(*fragments: str, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        resolved(*fragments, **kw)
    line = str(e.value)
    assert "\n" not in line
    return line


# ---- each fragment resolves, as a GPU would run it --------------------------------------------------------

GPU_ONLY = {  # fragments -> the one line a CPU gets
    ("zero2.json", "zenflow.json"): "ZenFlow (zero_optimization.zenflow) needs CUDA GPUs",
    ("zero3.json", "zenflow.json"): "ZenFlow (zero_optimization.zenflow) needs CUDA GPUs",
    ("zero3.json", "superoffload.json"): "SuperOffload (offload_optimizer.super_offload) needs NVIDIA CUDA GPUs",
    ("zero3.json", "deepcompile.json"): "DeepCompile (compile.deepcompile) needs CUDA GPUs",
    ("zero1.json", "deepcompile.json"): "DeepCompile (compile.deepcompile) needs CUDA GPUs",
    ("zero3.json", "offload_activations.json"): "DeepCompile's activation offload (compile.offload_activation) needs",
}


@pytest.mark.parametrize("fragments", list(GPU_ONLY), ids=["+".join(f) for f in GPU_ONLY])
def test_each_gpu_only_fragment_resolves_and_is_refused_only_off_cuda(fragments):
    ds, notes, cfg = resolved(*fragments)  # resolve ran DeepSpeed's own config models over it (schema.validate)
    assert gpu_only.machine_problems(ds, "cuda", fused_lion=True) == []
    [line] = gpu_only.machine_problems(ds, "cpu", fused_lion=False)
    assert line.startswith(GPU_ONLY[fragments]) and "on this CPU" in line and "ds_configs/" in line, line


def test_zenflow_runs_deepspeeds_zenflow_cpu_adam_and_its_interval_is_the_accumulation():
    ds, notes, cfg = resolved("zero2.json", "zenflow.json")
    z = ds["zero_optimization"]
    assert z["offload_optimizer"]["device"] == "cpu" and z["zenflow"]["update_interval"] == 4
    assert ds["gradient_accumulation_steps"] == 4 == cfg.gradient_accumulation_steps
    assert ds["train_batch_size"] == cfg.per_device_train_batch_size * 4 * 2
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["lr"] == cfg.learning_rate
    assert "gradient_accumulation_steps=4: ZenFlow's update_interval, which DeepSpeed makes the accumulation" in notes
    # a recipe's accumulation equal to the interval is not a conflict; without an optimizer block one is added
    ds, notes, _ = resolved("zero2.json", "zenflow.json", argv=["--gradient_accumulation_steps", "4"])
    assert ds["gradient_accumulation_steps"] == 4
    raw_zf = load_fragments(["ds_configs/zenflow.json"])["zero_optimization"]
    ds, notes, _ = resolved("zero2.json", extra={"zero_optimization": {**load_fragments(["ds_configs/zero2.json"])[
        "zero_optimization"], **raw_zf}})  # fmt: skip
    assert ds["optimizer"]["type"] == "AdamW" and any("ZenFlowCPUAdam" in n for n in notes)


def test_superoffload_says_clipping_turns_its_overlap_off():
    _, notes, _ = resolved("zero3.json", "superoffload.json")
    assert any(n.startswith("SuperOffload with gradient_clipping 1: DeepSpeed 0.19.8 starts") for n in notes)
    ds, notes, _ = resolved("zero3.json", "superoffload.json", argv=["--max_grad_norm", "0"])
    assert ds["gradient_clipping"] == 0 and not any(n.startswith("SuperOffload") for n in notes)


def test_deepcompile_turns_torch_compile_on_and_a_recipe_saying_off_is_a_conflict():
    _, notes, cfg = resolved("zero3.json", "deepcompile.json")
    assert (
        cfg.torch_compile is True
        and "adopted torch_compile=True (from the DeepSpeed config's compile.deepcompile)" in notes
    )
    line = refused("zero3.json", "deepcompile.json", argv=["--torch_compile", "false"])
    assert "compile.deepcompile=True but torch_compile=False" in line


def test_compiler_line_names_the_compiler_that_ran():
    ds, _, _ = resolved("zero3.json", "deepcompile.json")
    assert gpu_only.compiler_line(ds, True, "inductor").startswith(
        "compile: compiled with DeepCompile (ZeRO collectives"
    )
    # asked for but not started (DeepSpeed fell back): the line says what ran
    assert gpu_only.compiler_line(ds, False, "inductor").startswith("compile: compiled with torch.compile (inductor)")
    ds, _, _ = resolved("zero3.json", "offload_activations.json")
    assert "DeepCompile (activation offload, ZeRO-3, inductor)" in gpu_only.compiler_line(ds, True, "inductor")


# ---- refused on any machine: what DeepSpeed 0.19.8 rejects or ignores ----------------------------------------

ZF = {"zenflow": {"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 16, "update_interval": 4}}
CPU_OFFLOAD = {"offload_optimizer": {"device": "cpu"}}

REFUSED = [
    # (fragments, kw, what the line says)
    (("zero2.json", "zenflow.json"), {"zero": {"zenflow": {**ZF["zenflow"], "update_interval": "auto"}}},
     'zero_optimization.zenflow.update_interval = \'auto\': DeepSpeed makes ZenFlow\'s update interval the run\'s'),
    (("zero2.json", "zenflow.json"), {"extra": {"gradient_accumulation_steps": 2}},
     "gradient_accumulation_steps = 2 with zero_optimization.zenflow.update_interval = 4: ZenFlow overwrites"),
    (("zero2.json", "zenflow.json"), {"argv": ["--gradient_accumulation_steps", "8"]},
     "update_interval = 4 with gradient_accumulation_steps 8: ZenFlow overwrites the accumulation"),
    (("zero2.json", "zenflow.json"), {"zero": {"zenflow": {**ZF["zenflow"], "select_strategy": "auto"}}},
     'select_strategy = "auto" re-selects the important columns once an epoch'),
    (("zero2.json", "zenflow.json"), {"zero": {"zenflow": {**ZF["zenflow"], "select_interval": 2}}},
     "select_interval = 2 with select_strategy \"step\""),
    (("zero0.json",), {"zero": {**CPU_OFFLOAD, **ZF}}, "zero_optimization.zenflow needs ZeRO-1, 2 or 3"),
    (("zero2.json",), {"zero": ZF}, "zero_optimization.zenflow needs the optimizer offloaded to cpu"),
    (("zero2.json", "zenflow.json"), {"zero": {"zenflow": {**ZF["zenflow"], "offload": True}}},
     "zenflow.offload = true needs zero_optimization.overlap_comm = true"),
    (("zero2.json", "zenflow.json", "muon.json"), {}, "optimizer.type = 'Muon' with zero_optimization.zenflow"),
    (("zero2.json", "offload_optimizer.json"), {"zero": {"offload_optimizer": {"device": "cpu", "super_offload": True}}},
     "offload_optimizer.super_offload needs ZeRO-3; at ZeRO-2 DeepSpeed ignores it"),
    (("zero3.json", "superoffload.json"), {"zero": {"offload_optimizer": {"device": "none", "super_offload": True}}},
     "offload_optimizer.super_offload needs the optimizer offloaded to cpu"),
    (("zero0.json", "deepcompile.json"), {}, "compile.deepcompile needs ZeRO-1, 2 or 3; at ZeRO-0 DeepSpeed falls back"),
    (("zero3.json",), {"extra": {"compile": {"offload_activation": True}}},
     "compile.offload_activation is a DeepCompile pass; without compile.deepcompile DeepSpeed ignores it"),
    (("zero2.json", "offload_activations.json"), {}, "compile.offload_activation is DeepCompile's ZeRO-3 pass; at ZeRO-2"),
    (("zero3.json", "offload_all.json", "offload_activations.json"), {},
     "compile.offload_activation with compile.offload_parameters (DeepSpeed sets it when offload_param"),
    (("zero3.json", "offload_optimizer.json", "deepcompile.json"), {"extra": {"compile": {"offload_opt_states": True}}},
     "compile.offload_opt_states with zero_optimization.offload_optimizer"),
    # the pairs DeepSpeed forbids (checks._refuse_forbidden_pairs)
    (("zero3.json", "ep2.json"), {"zero": {"zero_quantized_gradients": True}},
     "expert_parallel (AutoEP) with ZeRO-3 and zero_quantized_gradients (qgZ)"),
    (("zero3.json", "ep2.json"), {"zero": {"zero_hpz_partition_size": 2}},
     "expert_parallel (AutoEP) with ZeRO-3 and zero_hpz_partition_size = 2 (hpZ)"),
    (("zero3.json", "muon.json"), {"zero": {"zero_quantized_gradients": True}},
     "zero_quantized_gradients (qgZ) with the Muon optimizer"),
]  # fmt: skip


@pytest.mark.parametrize("fragments,kw,says", REFUSED, ids=[r[2][:60] for r in REFUSED])
def test_refused_in_one_line_on_any_machine(fragments, kw, says):
    assert says in refused(*fragments, **kw)


# ---- other tools' spellings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fragments,extra,zero,where",
    [
        (("zero3.json",), {"deepcompile": True}, {}, ("compile", "deepcompile")),  # axolotl's option name
        (("zero2.json", "offload_optimizer.json"), {"zenflow": ZF["zenflow"]}, {}, ("zero_optimization", "zenflow")),
        (("zero3.json", "offload_optimizer.json"), {}, {"super_offload": True},
         ("zero_optimization", "offload_optimizer", "super_offload")),
    ],
)  # fmt: skip
def test_other_spellings_land_where_deepspeed_reads_them(fragments, extra, zero, where):
    ds, notes, _ = resolved(*fragments, extra=extra, zero=zero)
    node = ds
    for key in where:
        node = node[key]
    assert node and any(
        n.startswith("renamed ") and n.endswith(f"to {'.'.join(where)} (where DeepSpeed reads it)") for n in notes
    )
    assert gpu_only.machine_problems(ds, "cpu", fused_lion=False)  # and refused on this CPU as the fragment is


def test_two_spellings_of_one_switch_that_disagree_are_refused():
    line = refused("zero3.json", "deepcompile.json", extra={"deepcompile": False})
    assert "compile.deepcompile = True and deepcompile = False, two names for one DeepSpeed setting" in line


# ---- Lion, and this machine ----------------------------------------------------------------------------------

LION = {"optimizer": {"type": "Lion", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}}}


def test_lion_on_a_cpu_needs_optimizer_offload():
    ds, _, _ = resolved("zero2.json", extra=LION)
    [line] = gpu_only.machine_problems(ds, "cpu", fused_lion=False)
    assert (
        line.startswith("the Lion optimizer on this CPU needs optimizer offload") and "offload_optimizer.json" in line
    )
    assert gpu_only.machine_problems(ds, "cuda", fused_lion=True) == []
    ds, _, _ = resolved("zero2.json", "offload_optimizer.json", extra=LION)
    assert gpu_only.machine_problems(ds, "cpu", fused_lion=False) == []


def test_this_cpu_is_asked_for_real():
    """The machine's side with this machine's own accelerator: no FusedLion here, and the fragment refused."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        pytest.skip("a CPU check")
    assert checks.fused_lion(get_accelerator()) is False
    ds, _, _ = resolved("zero2.json", "zenflow.json")
    with pytest.raises(ConfigError, match="^ZenFlow .* needs CUDA GPUs"):
        checks.refuse_gpu_only(ds)
    assert checks.machine_problems(ds)[0].startswith("ZenFlow (zero_optimization.zenflow) needs CUDA GPUs")
