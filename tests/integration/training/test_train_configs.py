"""Every shipped DeepSpeed config trains for real (2 CPU ranks; the quick start's ZeRO-3 under the deepspeed
launcher, the rest under torchrun's agent with forked ranks: conftest.baseline_launcher), the loss falls, and bf16
stays near the exact fp32 answer. That every stage computes plain data parallel's fp32 losses, resumes after a
kill and exports the engine's model are the ZeRO rows of the contract table (tests/contract.py)."""

import pytest

from helpers import CONFIGS, EXPORT_TOL, PRECISIONS

FP32_TOL = 1e-5  # --torch_compile against eager: measured 1e-7 (the ZeRO stages against ZeRO-0: contract.PARITY)
# bf16 runs are compared with the fp32 ZeRO-0 run, the exact answer. ZeRO-1/2/3 and offload in bf16
# (DeepSpeed's ZeRO optimizers, fp32 master weights) stayed within 8.1e-4 of it. ZeRO-0 bf16 goes
# through DeepSpeed's FP16_UnfusedOptimizer and drifted 5.3e-2 by step 8, with or without clipping:
# measured, and kept visible with its own bound rather than hidden in a loose common one.
BF16_TOL = 2e-3
BF16_ZERO0_TOL = 1e-1


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_trains_and_loss_falls(trained, name, precision):
    run = trained(name, precision).check()
    losses = run.losses
    assert len(losses) == 8, run.log[-3000:]
    assert sum(losses[-2:]) / 2 < losses[0] - 0.5, f"loss did not fall: {losses}"
    assert "1 thread(s) per rank" in run.log  # under the deepspeed launcher OMP_NUM_THREADS was unset
    # export: the reloaded HF model reproduces the engine's logits
    diff = [r["export_max_abs_logit_diff"] for r in run.records if "export_max_abs_logit_diff" in r]
    assert diff and diff[0] <= EXPORT_TOL[precision], diff


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "zero3+nvme"])
def test_bf16_loss_parity_with_fp32(trained, name):
    ref = trained("zero0", "fp32").check().losses
    got = trained(name, "bf16").check().losses
    worst = max(abs(a - b) for a, b in zip(got, ref))
    tol = BF16_ZERO0_TOL if name == "zero0" else BF16_TOL
    assert worst <= tol, f"{name} bf16 diverges from fp32 zero0 by {worst:.3g}: {got} vs {ref}"


def test_grad_norm_is_logged_for_every_config(trained):
    for name in ("zero0", "zero2", "zero3"):
        norms = [r["grad_norm"] for r in trained(name, "fp32").check().records if "loss" in r]
        assert all(isinstance(n, float) and n > 0 for n in norms), (name, norms)
    ref = [r["grad_norm"] for r in trained("zero0", "fp32").records if "loss" in r]
    z2 = [r["grad_norm"] for r in trained("zero2", "fp32").records if "loss" in r]
    assert max(abs(a - b) / b for a, b in zip(z2, ref)) < 1e-3


def test_torch_compile_trains_with_the_same_losses(trained, tmp_path):
    """--torch_compile (DeepSpeed's engine.compile, inductor) changes how, not what: the same 8 fp32 losses
    as the eager ZeRO-2 run, through the launcher on 2 ranks. Measured agreement: 1e-7."""
    from helpers import FAST, launch

    ref = trained("zero2", "fp32").check()
    run = launch(
        FAST + ["--deepspeed", *CONFIGS["zero2"], "--torch_compile", "true", "--save_steps", "4"], tmp_path / "run"
    ).check()
    assert "compiled with torch.compile" in run.log
    worst = max(abs(a - b) for a, b in zip(run.losses, ref.losses))
    assert len(run.losses) == 8 and worst <= FP32_TOL, (run.losses, ref.losses)
