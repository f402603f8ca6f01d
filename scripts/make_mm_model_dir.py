#!/usr/bin/env python3
"""Makes a servable model dir from the tiny qwen3-omni-mm Thinker fixture: links its config.json
and model.safetensors and writes the word-level tokenizer.json and tokenizer_config.json (chat
template) that scripts/mm_word_tokenizer.json describes, the same files tests/server_mm.rs
builds (ModelDir). Standard library only.

    scripts/make_mm_model_dir.py OUT_DIR
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "crates/omni-models/tests/fixtures/qwen3-omni-mm")


def main(out: str) -> None:
    with open(os.path.join(ROOT, "scripts/mm_word_tokenizer.json")) as f:
        spec = json.load(f)
    os.makedirs(out, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        dst = os.path.join(out, name)
        if os.path.lexists(dst):
            os.remove(dst)
        os.symlink(os.path.join(FIXTURE, name), dst)
    specials = {i: text for i, text in spec["specials"]}
    vocab = {specials.get(i, f"w{i}"): i for i in range(spec["vocab_size"])}
    added = [
        {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, text in spec["specials"]
    ]
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": spec["unk_token"]},
    }
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": spec["chat_template"], "eos_token": spec["eos_token"]}, f)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
