#!/usr/bin/env python3
"""Write a word-level tokenizer.json with exactly VOCAB tokens ("w0" .. "w{VOCAB-1}", split on
whitespace) for benchmarking a --load-format dummy model of that vocabulary size: every token id
the random model samples decodes to text, and random prompts re-encode to the ids they came from.
Standard library only.

    python3 scripts/make_bench_tokenizer.py 151936 > /tmp/qwen3-8b/tokenizer.json
"""
import json
import sys


def main() -> None:
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        sys.exit("usage: make_bench_tokenizer.py VOCAB_SIZE")
    vocab = int(sys.argv[1])
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "WordLevel",
            "vocab": {f"w{i}": i for i in range(vocab)},
            "unk_token": "w0",
        },
    }
    json.dump(tok, sys.stdout, separators=(",", ":"))


if __name__ == "__main__":
    main()
