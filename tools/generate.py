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
from zero_recipes.evaluation.model_dir import check_model_dir, load


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
    from zero_recipes.evaluation import side_by_side

    model, tok = load(args.output_dir)
    decoding = side_by_side.Decoding(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        chat_template=not args.no_chat_template,
    )
    if args.show_prompt:
        prompt, templated = side_by_side.render_prompt(tok, args.prompt, decoding.chat_template)
        how = "chat template" if templated else "raw text"
        n = len(tok(prompt, add_special_tokens=not templated).input_ids)
        print(f"prompt ({how}, {n} tokens):\n{prompt}\n--- end of prompt", file=sys.stderr)
    return side_by_side.generate(model, tok, [args.prompt], decoding)[0]


if __name__ == "__main__":
    # stderr is for errors and --show_prompt: no transformers warnings or loading bars (read at its import)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    sys.exit(main(sys.argv[1:]))
