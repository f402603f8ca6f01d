#!/usr/bin/env python3
"""Tiny random checkpoints and Hugging Face transformers reference outputs for omni-models tests.

For each architecture this writes `crates/omni-models/tests/fixtures/<name>/`:

- `config.json`, `model.safetensors` (or shards + `model.safetensors.index.json`): random weights;
- `tokenizer.json`: a tiny byte-level BPE trained here on a few sentences;
- `reference.json`: prompts, their token ids, and greedy 32-token continuations
  (`generate(do_sample=False, use_cache=True)`);
- `reference.safetensors`: f32 logits for every position of each prompt (`logits.<i>`, `[T, vocab]`).

Run through `scripts/make-fixtures.sh`, which sets up the virtual environment.
"""

import copy
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "crates", "omni-models", "tests", "fixtures")
VOCAB = 320
NEW_TOKENS = 32

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Rust is a language empowering everyone to build reliable and efficient software.",
    "Large language models predict the next token from the tokens before it.",
    "Tensor parallelism splits attention heads and feed-forward columns across devices.",
    "Hello world! Hello tokens, hello blocks, hello attention.",
    "The scheduler batches prefills and decodes together in one step.",
]

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in blocks so that long",
]


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    return tok


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise with weights large enough that logits are well spread (no near ties)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / fan_in**0.5))


def common(**extra):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    base.update(extra)
    return base


ARCHS = [
    # name, config class, model class, config kwargs, dtype to save, max shard size
    ("llama", LlamaConfig, LlamaForCausalLM, common(tie_word_embeddings=True), torch.float32, None),
    (
        "llama3-rope-bf16",
        LlamaConfig,
        LlamaForCausalLM,
        common(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
        torch.bfloat16,
        None,
    ),
    (
        "qwen3",
        Qwen3Config,
        Qwen3ForCausalLM,
        common(head_dim=32, tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
        torch.float32,
        "150KB",
    ),
    (
        "qwen3-moe",
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        common(
            num_hidden_layers=3,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
        torch.float32,
        None,
    ),
]


def main() -> int:
    torch.manual_seed(0)
    tok = train_tokenizer()
    for i, (name, cfg_cls, model_cls, kwargs, dtype, shard) in enumerate(ARCHS):
        out = os.path.join(OUT, name)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        cfg = cfg_cls(**kwargs)
        model = model_cls(cfg).eval()
        randomize(model, seed=1000 + i)
        # The reference runs in f32 on exactly the weights that are saved: round the parameters
        # (not buffers such as RoPE's inv_freq) to the saved dtype first.
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(dtype).to(torch.float32))
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        save_kwargs = {"max_shard_size": shard} if shard else {}
        saved = copy.deepcopy(model).to(dtype)
        saved.config.dtype = dtype
        saved.save_pretrained(out, **save_kwargs)
        del saved
        tok.save(os.path.join(out, "tokenizer.json"))

        ref = {"prompts": [], "input_ids": [], "greedy": [], "min_greedy_margin": []}
        logits_out = {}
        for p_idx, prompt in enumerate(PROMPTS):
            ids = tok.encode(prompt).ids
            x = torch.tensor([ids], dtype=torch.long)
            with torch.no_grad():
                logits = model(x).logits[0].float().contiguous()
                gen = model.generate(
                    x,
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    use_cache=True,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
            new = gen.sequences[0, len(ids) :].tolist()
            assert len(new) == NEW_TOKENS, len(new)
            margins = []
            for s in gen.scores:
                top = torch.topk(s[0].float(), 2).values
                margins.append(float(top[0] - top[1]))
            logits_out[f"logits.{p_idx}"] = logits
            ref["prompts"].append(prompt)
            ref["input_ids"].append(ids)
            ref["greedy"].append(new)
            ref["min_greedy_margin"].append(min(margins))
        save_file(logits_out, os.path.join(out, "reference.safetensors"))
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump(ref, f, indent=1)
        print(f"{name}: prompts {[len(i) for i in ref['input_ids']]} tokens, min greedy margin {min(ref['min_greedy_margin']):.4f}")
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(OUT) for f in fs)
    print(f"fixtures: {total / 1e6:.2f} MB in {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
