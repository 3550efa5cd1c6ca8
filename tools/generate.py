"""Sample from a trained run's exported model (train.py leaves output_dir as an HF model directory, or as a
PEFT adapter directory after a LoRA run: the adapter is loaded onto the base its adapter_config.json names).

    python tools/generate.py outputs/tiny-llama "Return the number of"                # sampled, seed 0
    python tools/generate.py outputs/tiny-sft "What is 2 plus 3?" --temperature 0     # greedy
    python tools/generate.py outputs/tiny-sft "Hi" --top_p 0.95 --seed 7 --show_prompt  # + the prompt on stderr

The prompt goes in as one user message through the tokenizer's chat template (with the generation
prompt) when the tokenizer has one, which SFT runs save with their tokenizer; otherwise, or with
--no_chat_template, as raw text. Only the generated continuation is printed to stdout. The model runs
on the GPU if there is one (in its saved dtype), else on the CPU in fp32.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from zero_recipes.checkpoint import find_checkpoint
from zero_recipes.errors import ConfigError
from zero_recipes.lora import is_adapter_dir, load_for_inference

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
END_OF_TURN = "<|im_end|>"  # the default ChatML-style template's end of turn (plain text, not a special token)


class InputError(Exception):
    pass


def check_model_dir(d: Path) -> None:
    if not d.is_dir():
        raise InputError(f"{d} is not a directory; give a finished train.py --output_dir or an HF model directory")
    if is_adapter_dir(d) and (d / "adapter_model.safetensors").is_file():
        return
    if not (d / "config.json").is_file() or not any((d / w).is_file() for w in WEIGHTS):
        try:  # the checkpoint lookup export_hf.py and resume use: an output_dir, its checkpoints/ or a step-N
            found = find_checkpoint(d)
        except ConfigError as e:
            raise InputError(str(e)) from None
        if found is not None:
            run = d.parent.parent if d.parent.name == "checkpoints" else d.parent if d.name == "checkpoints" else d
            raise InputError(
                f"{d} holds DeepSpeed checkpoints but no exported model (a run stopped before its "
                f"export, or a checkpoint directory); export one with `python tools/export_hf.py {d} "
                f"{run}-hf`, then generate from {run}-hf"
            )
        raise InputError(
            f"{d} holds no HF model (config.json and weights); give a finished train.py --output_dir "
            "or a directory written by tools/export_hf.py"
        )
    if not (d / "tokenizer_config.json").is_file() and not (d / "tokenizer.json").is_file():
        raise InputError(f"{d} has a model but no tokenizer; save the tokenizer there with tokenizer.save_pretrained")


def render_prompt(tok, prompt: str, use_template: bool) -> tuple[str, bool]:
    """(the text fed to the model, whether the chat template made it)."""
    if use_template and getattr(tok, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), True
    return prompt, False


def stop_ids(tok, model) -> list[int]:
    """The tokenizer's EOS, plus the generation config's EOS ids that are special tokens (e.g. an
    instruct model's end-of-turn). A config EOS that is an ordinary token is left out: models exported before
    train.py took bos/eos from the tokenizer say 2, which the embedded tokenizer uses for '"', and stopping
    there would cut answers at the first quote."""
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    config_eos = model.generation_config.eos_token_id
    for i in config_eos if isinstance(config_eos, list) else [config_eos]:
        if i is not None and i in tok.all_special_ids and i not in ids:
            ids.append(i)
    return ids


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output_dir", type=Path, help="a finished train.py --output_dir, or any HF model directory")
    ap.add_argument("prompt", help="the user message (or raw text without a chat template)")
    ap.add_argument("--max_new_tokens", type=int, default=100, help="tokens to generate at most (default 100)")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 = greedy (default 0.7)")
    ap.add_argument("--top_p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0: the same command, the same text)")
    ap.add_argument(
        "--no_chat_template",
        action="store_true",
        help="feed the prompt as raw text even if the tokenizer has a chat template",
    )
    ap.add_argument("--show_prompt", action="store_true", help="print the exact text fed to the model on stderr")
    args = ap.parse_args(argv)
    try:
        if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
            raise InputError("need --max_new_tokens >= 1, --temperature >= 0 (0 = greedy) and 0 < --top_p <= 1")
        check_model_dir(args.output_dir)
        text = generate(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def generate(args) -> str:
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        tok = AutoTokenizer.from_pretrained(args.output_dir)
        # GPU: the saved dtype (bf16 stays bf16). CPU: fp32, since CPU bf16/fp16 kernels are slow or missing.
        dtype = "auto" if device == "cuda" else torch.float32
        if is_adapter_dir(args.output_dir):  # LoRA: the base the adapter names, then the adapter (peft)
            model = load_for_inference(args.output_dir, dtype, as_trained=False)
        else:
            model = AutoModelForCausalLM.from_pretrained(args.output_dir, dtype=dtype)
    except (OSError, ValueError, SafetensorError) as e:
        raise InputError(
            f"cannot load the model in {args.output_dir}: {str(e).splitlines()[0]}; check that it is "
            "a complete HF model directory, or export the run's checkpoint again with tools/export_hf.py"
        ) from None
    model.to(device).eval()
    prompt, templated = render_prompt(tok, args.prompt, not args.no_chat_template)
    # a chat template writes its own BOS if it wants one; raw text gets the tokenizer's usual specials
    enc = tok(prompt, return_tensors="pt", add_special_tokens=not templated).to(device)
    if enc.input_ids.shape[1] == 0:
        raise InputError("the prompt is empty; give some text to continue")
    if args.show_prompt:
        how = "chat template" if templated else "raw text"
        print(f"prompt ({how}, {enc.input_ids.shape[1]} tokens):\n{prompt}\n--- end of prompt", file=sys.stderr)
    stop = [END_OF_TURN] if templated and END_OF_TURN in prompt else None
    sampling = (
        dict(do_sample=True, temperature=args.temperature, top_p=args.top_p)
        if args.temperature > 0
        else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    )
    torch.manual_seed(args.seed)
    eos = stop_ids(tok, model) or None
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0] if eos else None
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=args.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            stop_strings=stop,
            tokenizer=tok if stop else None,
            **sampling,
        )
    text = tok.decode(out[0, enc.input_ids.shape[1] :], skip_special_tokens=True)
    return text.split(END_OF_TURN)[0] if stop else text


if __name__ == "__main__":
    # stderr is for errors and --show_prompt: no transformers warnings or loading bars (read at its import)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    sys.exit(main(sys.argv[1:]))
