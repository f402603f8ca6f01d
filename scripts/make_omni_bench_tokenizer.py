#!/usr/bin/env python3
"""Write tokenizer.json and tokenizer_config.json into a Qwen3-Omni model directory, for serving
and benchmarking a --load-format dummy model of the real shapes (bench/models/qwen3-omni-30b-a3b):

* tokenizer.json: a word-level tokenizer over the Thinker's whole vocabulary
  (thinker_config.text_config.vocab_size), token i being the word "w<i>", split on whitespace,
  so every id the random model samples decodes to text and prompts of "w<i>" words encode to
  exactly those ids. The ChatML specials <|im_start|> (151644) and <|im_end|> (151645) are in the
  vocabulary under their own text and are added special tokens, so they keep their real ids.
* tokenizer_config.json: a chat template that writes Qwen3-Omni's prompt ids: <|im_start|>, the
  role as the word of its id (w8948 system, w872 user, w77091 assistant), w198 for the newline,
  the content, <|im_end|> w198; the generation prompt is <|im_start|>w77091 w198. EOS <|im_end|>.

The same tokenizer as tests/omni_common.rs fixture_with_tokenizer builds for the tiny fixture.
Standard library only.

    python3 scripts/make_omni_bench_tokenizer.py bench/models/qwen3-omni-30b-a3b [OUT_DIR]
"""
import json
import os
import sys

IM_START = ("<|im_start|>", 151644)
IM_END = ("<|im_end|>", 151645)
ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77091}
NEWLINE_ID = 198

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>"
    "{% if m.role == 'system' %}w" + str(ROLE_IDS["system"]) + ""
    "{% elif m.role == 'user' %}w" + str(ROLE_IDS["user"]) + ""
    "{% else %}w" + str(ROLE_IDS["assistant"]) + "{% endif %}"
    " w" + str(NEWLINE_ID) + " {{ m.content }}<|im_end|> w" + str(NEWLINE_ID) + " {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>w" + str(ROLE_IDS["assistant"])
    + " w" + str(NEWLINE_ID) + "{% endif %}"
)


def tokenizer_json(vocab_size: int) -> dict:
    specials = dict((tid, text) for text, tid in (IM_START, IM_END))
    for tid in specials:
        if tid >= vocab_size:
            sys.exit(f"vocab_size {vocab_size} has no room for special id {tid}")
    vocab = {specials.get(i, f"w{i}"): i for i in range(vocab_size)}
    added = [
        {
            "id": tid,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for tid, text in sorted(specials.items())
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"},
    }


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: make_omni_bench_tokenizer.py MODEL_DIR [OUT_DIR]")
    model_dir = sys.argv[1]
    out_dir = sys.argv[2] if len(sys.argv) == 3 else model_dir
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    try:
        vocab_size = int(config["thinker_config"]["text_config"]["vocab_size"])
    except (KeyError, TypeError, ValueError):
        sys.exit(f"{model_dir}/config.json has no thinker_config.text_config.vocab_size")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(vocab_size), f, separators=(",", ":"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": IM_END[0]}, f, indent=2)
    print(f"wrote tokenizer.json ({vocab_size} tokens) and tokenizer_config.json to {out_dir}")


if __name__ == "__main__":
    main()
