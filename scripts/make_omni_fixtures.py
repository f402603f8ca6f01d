#!/usr/bin/env python3
"""A tiny random Qwen3-Omni checkpoint and Hugging Face transformers reference outputs for omni-models tests.

Writes `crates/omni-models/tests/fixtures/qwen3-omni/`:

- `config.json`, `generation_config.json`, `model.safetensors`: a `Qwen3OmniMoeForConditionalGeneration` built from
  a config only (no hub access), random weights, saved by `save_pretrained` in bfloat16 (hub layout, per-expert
  tensors). The real checkpoint's token ids, vocabularies, codebook sizes, code groups and upsampling rates are kept;
  the widths and depths are tiny. The thinker's `embed_tokens` and `lm_head` are zero outside an active id set S
  (ids 0..1023 plus the chat/TTS special ids), and the tables over codec vocabularies (talker codec embedding and
  head, code predictor embeddings and heads, Code2Wav codebooks) hold random ternary values; both keep the committed
  file small once compressed.
- `reference.safetensors` (float32; integer tensors are stored as float32 too) and `reference.json`:
  * thinker, text-only chat prompts: `thinker.logits.{i}` `[T_i, |S|]` (the logits restricted to S, every other
    column is exactly 0), `thinker.hidden.0.{i}` / `thinker.hidden.{A}.{i}` `[T_i, hidden]` (`output_hidden_states`
    entries 0 and `accept_hidden_layer`), `thinker.mrope.position_ids` `[3, T_0]` and `thinker.mrope.logits`
    `[T_0, |S|]` (prompt 0 run with three different M-RoPE position rows); reference.json `thinker.prompts`,
    `thinker.logit_ids` (S) and `thinker.greedy.{i}`;
  * talker, captured from `Qwen3OmniMoeForConditionalGeneration.generate` (greedy thinker and talker) for each
    prompt and speaker: `talker.prefill_embeds.{i}.{speaker}` `[P, H]`, `talker.trailing_text.{i}.{speaker}`
    `[N, H]`, `talker.tts_pad_embed` `[H]`, `talker.prefill_logits.{i}.{speaker}` `[P, talker vocab]` (raw
    `codec_head` output) and `talker.frames.{i}.{speaker}` `[F, num_code_groups]` (the codes handed to Code2Wav);
    reference.json `talker.thinker_sequence.{i}`, `talker.speakers` and `talker.layer0_codes.{i}.{speaker}` (every
    layer-0 code the talker sampled: a frame is completed one step after its layer-0 code, so the last code, EOS or
    the one at `max_new_tokens`, has no frame);
  * `*.min_greedy_margin`: the smallest top-1/top-2 gap among the greedy choices (thinker, talker layer 0 after
    suppression and repetition penalty, code predictor), a measure of how much numerical slack a reimplementation has;
  * code2wav: `code2wav.codes.{T}` `[16, T]` and `code2wav.wav.{T}` `[1920*T - 555]` for T in reference.json
    `code2wav.lengths` (80 exceeds the 72-frame attention window), and a 3-window
    streaming decode (`code2wav.stream.codes`, `code2wav.stream.wav.{k}`, reference.json `code2wav.stream.windows`
    as `[start, end, left_context]`) trimmed the way vLLM-Omni's `chunked_decode_streaming` trims.

Every weight is exactly bfloat16-representable and every reference is computed in float32 on those values, so a
reader that loads the bf16 file into f32 computes on identical numbers.

Run through `scripts/make-omni-fixtures.sh`, which sets up the virtual environment.
"""

import hashlib
import json
import math
import os
import re
import shutil
import sys
import zlib

import torch
from safetensors.torch import save_file
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

# The token ids are used through this module by make_omni_mm_fixtures.py too.
from fixture_util import (
    ASSISTANT,
    AUDIO,
    AUDIO_END,
    AUDIO_START,
    IM_END,
    IM_START,
    IMAGE,
    NEWLINE,
    SPECIAL_IDS,
    SYSTEM,
    TTS_BOS,
    TTS_EOS,
    TTS_PAD,
    USER,
    VIDEO,
    VISION_END,
    VISION_START,
    save_bf16_checked,
)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "crates", "omni-models", "tests", "fixtures", "qwen3-omni")

ACTIVE = sorted(set(range(1024)) | set(SPECIAL_IDS))

ACCEPT_HIDDEN_LAYER = 2
UPSAMPLE_RATES = [8, 5, 4, 3]
SPEAKERS = ["chelsie", "ethan"]
THINKER_NEW_TOKENS = 8
TALKER_NEW_TOKENS = 12
# 80 > sliding_window (72): the only length where Code2Wav's attention window changes the output.
CODE2WAV_LENGTHS = [1, 4, 25, 29, 50, 80]
# vLLM-Omni's async chunking (initial 4 frames, then 25 with 25 frames of left context) over 54 frames.
STREAM_FRAMES = 54
STREAM_WINDOWS = [(0, 4, 0), (0, 29, 4), (4, 54, 25)]


def make_config() -> Qwen3OmniMoeConfig:
    rope_thinker = dict(rope_type="default", rope_theta=1000000.0, mrope_section=[4, 2, 2], interleaved=True)
    thinker_text = dict(
        vocab_size=152064,
        hidden_size=32,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=65536,
        rms_norm_eps=1e-6,
        rope_parameters=rope_thinker,
        attention_bias=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    audio = dict(
        num_mel_bins=128,
        encoder_layers=1,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        d_model=32,
        output_dim=32,
        downsample_hidden_size=8,
        max_source_positions=1500,
        n_window=50,
        n_window_infer=800,
        conv_chunksize=500,
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=32,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    thinker = dict(
        text_config=thinker_text,
        audio_config=audio,
        vision_config=vision,
        audio_token_id=AUDIO,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        audio_start_token_id=AUDIO_START,
        audio_end_token_id=AUDIO_END,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        user_token_id=USER,
        position_id_per_seconds=13,
        seconds_per_chunk=2,
        tie_word_embeddings=False,
    )
    talker_text = dict(
        vocab_size=3072,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=65536,
        rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[4, 2, 2], interleaved=True),
        attention_bias=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    code_predictor = dict(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        attention_bias=False,
        num_code_groups=16,
        layer_types=["full_attention", "full_attention"],
        tie_word_embeddings=False,
    )
    talker = dict(
        text_config=talker_text,
        code_predictor_config=code_predictor,
        num_code_groups=16,
        thinker_hidden_size=32,
        accept_hidden_layer=ACCEPT_HIDDEN_LAYER,
        codec_eos_token_id=2150,
        codec_nothink_id=2155,
        codec_think_bos_id=2156,
        codec_think_eos_id=2157,
        codec_pad_id=2148,
        codec_bos_id=2149,
        audio_token_id=AUDIO,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        audio_start_token_id=AUDIO_START,
        position_id_per_seconds=13,
        seconds_per_chunk=2,
        spatial_merge_size=2,
        speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        tie_word_embeddings=False,
    )
    code2wav = dict(
        codebook_size=2048,
        num_quantizers=16,
        num_semantic_quantizers=1,
        semantic_codebook_size=4096,
        codebook_dim=512,
        vector_quantization_hidden_dimension=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_bias=False,
        sliding_window=72,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        rms_norm_eps=1e-5,
        layer_scale_initial_scale=0.01,
        decoder_dim=64,
        upsample_rates=UPSAMPLE_RATES,
        upsampling_ratios=[2, 2],
        max_position_embeddings=8000,
    )
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=IM_START,
        im_end_token_id=IM_END,
        tts_pad_token_id=TTS_PAD,
        tts_bos_token_id=TTS_BOS,
        tts_eos_token_id=TTS_EOS,
        system_token_id=SYSTEM,
        user_token_id=USER,
        assistant_token_id=ASSISTANT,
        tie_word_embeddings=False,
    )


# Tables over a codec vocabulary (code predictor, talker codec, Code2Wav codebooks: ~6.4 M values) hold random
# ternary values {-1, 0, 1} * scale (38 % zeros). Every row is still a distinct random vector, but the table
# compresses to ~2.4 bits a value instead of ~13 for random bf16, which keeps the committed file small.
TERNARY_TABLES = (
    "talker.model.codec_embedding.weight",
    "talker.codec_head.weight",
    "talker.code_predictor.model.codec_embedding.",
    "talker.code_predictor.lm_head.",
    "code2wav.code_embedding.weight",
)


def ternary(shape, scale, gen):
    x = torch.randn(shape, generator=gen)
    return torch.where(x.abs() < 0.5, 0.0, torch.sign(x)) * scale


def conv_gain(name: str) -> float:
    """Code2Wav's decoder: damped residual units, transposed convs and output conv, so that activations stay O(1)
    (a wav mostly inside the [-1, 1] clamp, and f32 rounding noise is not amplified through the 4 blocks)."""
    if re.fullmatch(r"code2wav\.decoder\.\d+\.block\.[234]\.conv[12]\.conv\.weight", name):
        return 0.3
    if re.fullmatch(r"code2wav\.decoder\.\d+\.block\.1\.conv\.weight", name):
        return 0.7
    if name == f"code2wav.decoder.{len(UPSAMPLE_RATES) + 2}.conv.weight":
        return 0.3
    return 1.0


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise every parameter (weights spread enough that greedy choices have clear margins)."""
    from torch import nn

    gen = torch.Generator().manual_seed(seed)
    active = torch.tensor(ACTIVE)
    seen = set()

    def randn(shape, std):
        return torch.randn(shape, generator=gen) * std

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=gen)

    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            cls = type(mod).__name__
            for p_name, p in mod.named_parameters(recurse=False):
                name = f"{mod_name}.{p_name}"
                shape = p.shape
                if name.startswith(TERNARY_TABLES):
                    # Embeddings: std 0.79; output heads: std 0.2 ~ 1.5 / sqrt(hidden).
                    scale = 1.0 if "embedding" in name else 0.25
                    value = ternary(shape, scale, gen)
                elif name in ("thinker.model.language_model.embed_tokens.weight", "thinker.lm_head.weight"):
                    std = 1.0 if "embed_tokens" in name else 1.5 / math.sqrt(shape[1])
                    value = torch.zeros(shape)
                    value[active] = randn((len(ACTIVE), shape[1]), std)
                elif "RMSNorm" in cls:
                    value = 1.0 + randn(shape, 0.1)
                elif isinstance(mod, nn.LayerNorm):
                    value = 1.0 + randn(shape, 0.1) if p_name == "weight" else randn(shape, 0.1)
                elif "SnakeBeta" in cls:  # log-scale alpha (frequency) and beta (magnitude)
                    value = randn(shape, 0.1)
                elif "LayerScale" in cls or (cls == "Qwen3OmniMoeConvNeXtBlock" and p_name == "gamma"):
                    value = uniform(shape, 0.05, 0.5)
                elif p_name == "bias":
                    value = randn(shape, 0.1)
                elif isinstance(mod, nn.Linear) or "Router" in cls:
                    value = randn(shape, 1.5 / math.sqrt(shape[1]))
                elif "Experts" in cls:  # [E, out, in]
                    value = randn(shape, 1.5 / math.sqrt(shape[2]))
                elif isinstance(mod, nn.ConvTranspose1d):  # [in, out, k]
                    value = randn(shape, conv_gain(name) / math.sqrt(shape[0] * shape[2] / mod.stride[0]))
                elif isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):  # [out, in/groups, *k]
                    value = randn(shape, conv_gain(name) / math.sqrt(p[0].numel()))
                elif isinstance(mod, nn.Embedding):
                    value = randn(shape, 0.5)
                else:
                    raise AssertionError(f"no init rule for {name} ({cls}, {tuple(shape)})")
                # Exactly bf16-representable, computed on in f32.
                p.copy_(value.to(torch.bfloat16).to(torch.float32))
                seen.add(name)
    assert seen == {n for n, _ in model.named_parameters()}, "some parameters were not initialised"


def chat_prompt(gen, user_len, system_len=0):
    def rand_ids(n):
        return torch.randint(0, 1024, (n,), generator=gen).tolist()

    ids = []
    if system_len:
        ids += [IM_START, SYSTEM, NEWLINE] + rand_ids(system_len) + [IM_END, NEWLINE]
    ids += [IM_START, USER, NEWLINE] + rand_ids(user_len) + [IM_END, NEWLINE]
    ids += [IM_START, ASSISTANT, NEWLINE]
    return ids


def top2_margin(scores: torch.Tensor) -> float:
    top = torch.topk(scores.float().reshape(-1), 2).values
    return float(top[0] - top[1])


def thinker_references(model, prompts, ref, out):
    thinker = model.thinker
    text_model = thinker.model.language_model
    cols = torch.tensor(ACTIVE)
    outside = torch.ones(thinker.config.text_config.vocab_size, dtype=torch.bool)
    outside[cols] = False
    margins = []
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids])
        res = thinker(input_ids=x, output_hidden_states=True)
        logits = res.logits[0]
        assert torch.all(logits[:, outside] == 0), "logits outside the active set must be exactly 0"
        out[f"thinker.logits.{i}"] = logits[:, cols].contiguous()
        hs = res.hidden_states
        assert len(hs) == thinker.config.text_config.num_hidden_layers + 1, len(hs)
        assert torch.equal(hs[0][0], text_model.embed_tokens(x)[0])
        out[f"thinker.hidden.0.{i}"] = hs[0][0].contiguous()
        out[f"thinker.hidden.{ACCEPT_HIDDEN_LAYER}.{i}"] = hs[ACCEPT_HIDDEN_LAYER][0].contiguous()

        gen = thinker.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=THINKER_NEW_TOKENS,
            do_sample=False,
            eos_token_id=IM_END,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new = gen.sequences[0, len(ids) :].tolist()
        ref[f"thinker.greedy.{i}"] = new
        margins += [top2_margin(s) for s in gen.scores]
        # The greedy path reproduces the full-prompt logits' argmax at the first step.
        assert new[0] == int(logits[-1].argmax()), (new, int(logits[-1].argmax()))

    # Interleaved M-RoPE with three different position rows (temporal, height, width) on prompt 0.
    t = len(prompts[0])
    pos = torch.stack([torch.arange(t), torch.arange(t) // 2, torch.arange(t) % 3 + 5])
    x = torch.tensor([prompts[0]])
    hidden = text_model(input_ids=x, position_ids=pos[:, None, :]).last_hidden_state
    mrope_logits = thinker.lm_head(hidden)[0]
    plain = out["thinker.logits.0"]
    assert not torch.allclose(mrope_logits[:, cols], plain, atol=1e-3), "M-RoPE positions had no effect"
    # Equal rows reduce to the ordinary positions.
    same = text_model(input_ids=x, position_ids=torch.arange(t).expand(3, 1, t)).last_hidden_state
    assert torch.allclose(thinker.lm_head(same)[0][:, cols], plain, atol=1e-5)
    out["thinker.mrope.position_ids"] = pos.float().contiguous()
    out["thinker.mrope.logits"] = mrope_logits[:, cols].contiguous()
    ref["thinker.min_greedy_margin"] = min(margins)


def expected_talker_prefill(model, seq, prompt_len, speaker):
    """omni.md §2.2, written out: the talker's prefill inputs and trailing text for a text-only prompt."""
    cfg, tcfg = model.config, model.config.talker_config
    embed = model.thinker.model.language_model.embed_tokens
    proj = model.talker.text_projection
    codec = model.talker.get_input_embeddings()
    # The thinker's layer-0 states cover prompt + generated[:-1]: the last generated token is never fed back.
    fed = torch.tensor(seq[:-1])
    starts = [p for p, t in enumerate(seq[:prompt_len]) if t == IM_START] + [prompt_len]
    user = [p for a, b in zip(starts, starts[1:]) if seq[a + 1] == USER for p in range(a, b)]
    assistant = starts[-2]
    assert seq[assistant + 1] == ASSISTANT
    tts_bos, tts_eos, tts_pad = proj(embed(torch.tensor([TTS_BOS, TTS_EOS, TTS_PAD])))
    a = proj(embed(fed[assistant:]))
    spk = tcfg.speaker_id[speaker]
    text_side = torch.stack([a[0], a[1], a[2], tts_pad, tts_pad, tts_pad, tts_pad, tts_bos, a[3]])
    codec_ids = [tcfg.codec_nothink_id, tcfg.codec_think_bos_id, tcfg.codec_think_eos_id, spk, tcfg.codec_pad_id]
    codec_side = torch.cat([torch.zeros(3, tcfg.text_config.hidden_size), codec(torch.tensor(codec_ids + [tcfg.codec_bos_id]))])
    prefill = torch.cat([proj(embed(fed[user])), text_side + codec_side])
    trailing = torch.cat([a[4:], tts_eos[None]])
    assert cfg.im_start_token_id == IM_START
    return prefill, trailing, tts_pad


def talker_references(model, prompts, ref, out):
    talker, cp = model.talker, model.talker.code_predictor
    tcfg = model.config.talker_config
    vocab = tcfg.text_config.vocab_size
    suppressed = [t for t in range(vocab - 1024, vocab) if t != tcfg.codec_eos_token_id]
    talker_margins, cp_margins = [], []
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids])
        for speaker in SPEAKERS:
            cap = {"forward": [], "model": [], "cp": []}
            talker_generate, cp_generate, decode = talker.generate, cp.generate, model.code2wav.chunked_decode

            def capture_talker_generate(**kw):
                cap["kw"] = kw
                cap["result"] = talker_generate(**kw)
                return cap["result"]

            def capture_cp_generate(**kw):
                res = cp_generate(output_scores=True, **kw)
                cap["cp"].append((kw["inputs_embeds"], res))
                return res

            def capture_decode(codes, **kw):
                cap["codes"] = codes
                return decode(codes, **kw)

            def talker_hook(mod, args, kwargs, output):
                cap["forward"].append((kwargs["inputs_embeds"], output.logits))

            def model_hook(mod, args, kwargs, output):
                cap["model"].append(output.last_hidden_state)

            talker.generate, cp.generate, model.code2wav.chunked_decode = (
                capture_talker_generate,
                capture_cp_generate,
                capture_decode,
            )
            hooks = [
                talker.register_forward_hook(talker_hook, with_kwargs=True),
                talker.model.register_forward_hook(model_hook, with_kwargs=True),
            ]
            try:
                sequences, wav = model.generate(
                    input_ids=x,
                    attention_mask=torch.ones_like(x),
                    speaker=speaker,
                    return_audio=True,
                    thinker_max_new_tokens=THINKER_NEW_TOKENS,
                    thinker_do_sample=False,
                    talker_do_sample=False,
                    talker_max_new_tokens=TALKER_NEW_TOKENS,
                    talker_output_logits=True,
                )
            finally:
                for h in hooks:
                    h.remove()
                del talker.generate, cp.generate, model.code2wav.chunked_decode

            seq = sequences[0].tolist()
            assert seq[: len(ids)] == ids
            assert seq[len(ids) :] == ref[f"thinker.greedy.{i}"], "full generate's thinker differs from thinker.generate"
            if f"talker.thinker_sequence.{i}" in ref:
                assert ref[f"talker.thinker_sequence.{i}"] == seq
            ref[f"talker.thinker_sequence.{i}"] = seq

            kw = cap["kw"]
            prefill = kw["inputs_embeds"][0]
            trailing = kw["trailing_text_hidden"][0]
            tts_pad = kw["tts_pad_embed"][0, 0]
            want_prefill, want_trailing, want_pad = expected_talker_prefill(model, seq, len(ids), speaker)
            assert prefill.shape == want_prefill.shape and torch.allclose(prefill, want_prefill, atol=1e-5)
            assert trailing.shape == want_trailing.shape and torch.allclose(trailing, want_trailing, atol=1e-5)
            assert torch.allclose(tts_pad, want_pad, atol=1e-6)

            # Forward 0 is the prefill; forward k >= 1 is decode step k, fed by frame k-1.
            pre_embeds, pre_logits = cap["forward"][0]
            assert torch.equal(pre_embeds[0], prefill)
            result = cap["result"]
            layer0 = result.sequences[0].tolist()
            codes = cap["codes"][0].T  # [F, 16]
            frames = codes.shape[0]
            assert frames == len(cap["cp"]) == len(cap["forward"]) - 1
            assert codes[:, 0].tolist() == layer0[:frames]
            assert wav.shape[-1] == 1920 * frames - 555, (wav.shape, frames)
            # Greedy layer-0 choice: raw codec_head logits, repetition penalty 1.05 over the codes generated so far,
            # the [vocab-1024, vocab) range except codec_eos suppressed, argmax.
            for step, raw in enumerate(result.logits):
                raw = raw[0].clone()
                fwd_logits = cap["forward"][step][1][0, -1]
                assert torch.equal(raw, fwd_logits)
                prev = torch.tensor(sorted(set(layer0[:step])), dtype=torch.long)
                if len(prev):
                    v = raw[prev]
                    raw[prev] = torch.where(v < 0, v * 1.05, v / 1.05)
                raw[suppressed] = -float("inf")
                assert int(raw.argmax()) == layer0[step], (step, int(raw.argmax()), layer0[step])
                talker_margins.append(top2_margin(raw))
            # The code predictor starts from the talker's final-norm output at the position that emitted the code.
            for k, (cp_in, cp_res) in enumerate(cap["cp"]):
                last_hidden = cap["model"][k][0, -1]
                assert torch.equal(cp_in[0, 0], last_hidden), "code predictor input 0 is not the final-norm state"
                assert torch.equal(cp_in[0, 1], talker.get_input_embeddings()(torch.tensor(layer0[k])))
                assert cp_res.sequences[0].tolist() == codes[k, 1:].tolist()
                for g, s in enumerate(cp_res.scores):  # greedy too when talker_do_sample=False
                    assert int(s[0].argmax()) == codes[k, 1 + g]
                    cp_margins.append(top2_margin(s))
                # The next talker input: the 16 codec embeddings of the frame plus one trailing-text row
                # (the trailing text ends with tts_eos; tts_pad once it is used up).
                step_text = trailing[k] if k < trailing.shape[0] else tts_pad
                cp_tables = cp.get_input_embeddings()
                want = talker.get_input_embeddings()(codes[k, 0]) + step_text
                for g in range(1, codes.shape[1]):
                    want = want + cp_tables[g - 1](codes[k, g])
                assert torch.allclose(cap["forward"][k + 1][0][0, 0], want, atol=1e-5)

            key = f"{i}.{speaker}"
            out[f"talker.prefill_embeds.{key}"] = prefill.contiguous()
            out[f"talker.trailing_text.{key}"] = trailing.contiguous()
            out[f"talker.prefill_logits.{key}"] = pre_logits[0].contiguous()
            out[f"talker.frames.{key}"] = codes.float().contiguous()
            out["talker.tts_pad_embed"] = tts_pad.contiguous()
            ref[f"talker.layer0_codes.{key}"] = layer0
            print(
                f"talker {key}: thinker {len(ids)}+{len(seq) - len(ids)} tokens, prefill {prefill.shape[0]}, "
                f"trailing {trailing.shape[0]}, layer-0 codes {layer0}, frames {frames}, wav {wav.shape[-1]}"
            )
    ref["talker.speakers"] = SPEAKERS
    ref["talker.min_greedy_margin"] = min(talker_margins)
    ref["code_predictor.min_greedy_margin"] = min(cp_margins)


def code2wav_references(model, ref, out):
    c2w = model.code2wav
    cfg = model.config.code2wav_config
    up = int(c2w.total_upsample)
    assert up == 1920
    gen = torch.Generator().manual_seed(7)

    def codes_of(t):
        return torch.randint(0, cfg.codebook_size, (cfg.num_quantizers, t), generator=gen)

    clipped = 0
    total = 0
    for t in CODE2WAV_LENGTHS:
        codes = codes_of(t)
        wav = c2w(codes[None])[0, 0]
        assert wav.shape[0] == up * t - 555, (t, wav.shape)
        clipped += int((wav.abs() >= 1).sum())
        total += wav.numel()
        out[f"code2wav.codes.{t}"] = codes.float().contiguous()
        out[f"code2wav.wav.{t}"] = wav.contiguous()
        if t > cfg.sliding_window:
            # The window matters: without it only the first `sliding_window` frames' samples stay the same.
            window_cfg, window = c2w.pre_transformer.config, cfg.sliding_window
            window_cfg.sliding_window = 1 << 20
            try:
                unwindowed = c2w(codes[None])[0, 0]
            finally:
                window_cfg.sliding_window = window
            keep = up * window - 555
            assert torch.allclose(unwindowed[:keep], wav[:keep], atol=1e-5)
            assert (unwindowed[keep:] - wav[keep:]).abs().max() > 1e-3, "sliding window had no effect"
    ref["code2wav.lengths"] = CODE2WAV_LENGTHS
    ref["code2wav.clipped_fraction"] = clipped / total

    codes = codes_of(STREAM_FRAMES)
    one_shot = c2w(codes[None])[0, 0]
    pieces = []
    for k, (start, end, left) in enumerate(STREAM_WINDOWS):
        w = end - start
        wav = c2w(codes[None, :, start:end])[0, 0]
        tail = w * up - wav.shape[0]
        piece = wav[max(0, left * up - tail) : w * up]
        out[f"code2wav.stream.wav.{k}"] = piece.contiguous()
        pieces.append(piece)
    stream = torch.cat(pieces)
    assert stream.shape[0] == up * STREAM_FRAMES - 555, stream.shape
    assert torch.allclose(pieces[0], one_shot[: pieces[0].shape[0]], atol=1e-5)
    out["code2wav.stream.codes"] = codes.float().contiguous()
    ref["code2wav.stream.windows"] = [list(w) for w in STREAM_WINDOWS]


def git_size(path: str) -> int:
    return len(zlib.compress(open(path, "rb").read(), 6))


def main() -> int:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)

    cfg = make_config()
    model = Qwen3OmniMoeForConditionalGeneration(cfg).eval()
    randomize(model, seed=2024)

    # The saved file (hub layout) loads back to exactly the weights the references are computed on.
    save_bf16_checked(Qwen3OmniMoeForConditionalGeneration, cfg, model, OUT, set_config_dtype=True)

    gen = torch.Generator().manual_seed(1)
    prompts = [chat_prompt(gen, 10), chat_prompt(gen, 9, system_len=5)]
    ref = {
        "thinker.prompts": prompts,
        "thinker.logit_ids": ACTIVE,
        "thinker.accept_hidden_layer": ACCEPT_HIDDEN_LAYER,
    }
    out = {}
    with torch.no_grad():
        thinker_references(model, prompts, ref, out)
        talker_references(model, prompts, ref, out)
        code2wav_references(model, ref, out)

    out = {k: v.float().contiguous() for k, v in sorted(out.items())}
    save_file(out, os.path.join(OUT, "reference.safetensors"))
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        # One key a line, values compact.
        lines = [f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in ref.items()]
        f.write("{\n" + ",\n".join(lines) + "\n}\n")
    assert json.load(open(os.path.join(OUT, "reference.json"))) == ref

    for k, v in out.items():
        print(f"  {k} {list(v.shape)}")
    print(
        f"margins: thinker {ref['thinker.min_greedy_margin']:.4f}, talker {ref['talker.min_greedy_margin']:.4f}, "
        f"code predictor {ref['code_predictor.min_greedy_margin']:.4f}; code2wav clipped {ref['code2wav.clipped_fraction']:.4f}"
    )
    total = 0
    for name in sorted(os.listdir(OUT)):
        path = os.path.join(OUT, name)
        size, packed = os.path.getsize(path), git_size(path)
        total += packed
        print(f"  {name}: {size / 1e6:.2f} MB, {packed / 1e6:.2f} MB compressed")
    digest = hashlib.sha256(open(os.path.join(OUT, "reference.safetensors"), "rb").read()).hexdigest()
    print(f"fixtures: {total / 1e6:.2f} MB compressed in {OUT}; reference.safetensors sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
