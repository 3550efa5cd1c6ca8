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

from zero_recipes.errors import ConfigError
from zero_recipes.evaluation.model_dir import check_model_dir
from zero_recipes.evaluation.side_by_side import END_OF_TURN, render_prompt, stop_ids
from zero_recipes.lora import is_adapter_dir, load_for_inference


class InputError(Exception):
    pass


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
    except (InputError, ConfigError) as e:
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
