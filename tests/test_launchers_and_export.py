"""torchrun works like the deepspeed launcher; the exported model is the trained model."""

import torch

from conftest import FAST, launch


def test_torchrun_matches_deepspeed_launcher(trained, tmp_path):
    ref = trained("zero2", "fp32").check()
    run = launch(FAST + ["--deepspeed", "ds_configs/zero2.json"], tmp_path / "run", launcher="torchrun").check()
    assert max(abs(a - b) for a, b in zip(run.losses, ref.losses)) <= 1e-6
    assert len(run.losses) == len(ref.losses) == 8


def test_zero3_export_holds_the_gathered_trained_weights(trained):
    """Not empty ZeRO-3 placeholders: every tensor equals DeepSpeed's own consolidation of the checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = trained("zero3", "fp32").check()
    model = AutoModelForCausalLM.from_pretrained(run.output_dir)
    tok = AutoTokenizer.from_pretrained(run.output_dir)
    assert len(tok) == model.config.vocab_size
    ref = get_fp32_state_dict_from_zero_checkpoint(str(run.output_dir / "checkpoints"))
    exported = model.state_dict()
    assert set(ref) <= set(exported)
    for name, tensor in ref.items():
        assert exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name], tensor.to(exported[name].dtype)), name
    # and it is a trained model, not the initialisation: it predicts the corpus better than chance
    ids = tok("Return the number of items in the container.", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < torch.log(torch.tensor(float(model.config.vocab_size))).item() - 0.5
