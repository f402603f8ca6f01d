#!/usr/bin/env python3
"""A tiny random Qwen3-Omni Thinker with both encoder towers, and Hugging Face transformers references for its
multimodal forward (omni-models tests `omni_mm_encoders`).

Writes `crates/omni-models/tests/fixtures/qwen3-omni-mm/`:

- `config.json`: a whole `Qwen3OmniMoeForConditionalGeneration` config (the Thinker of
  `make_omni_fixtures.py` with larger towers: audio 2 layers, d_model 32, `n_window_infer` 200 so a clip longer
  than two 100-frame chunks spans several attention windows; vision depth 3, hidden 32, `deepstack_visual_indexes`
  [0, 2]). The real checkpoint's token ids are kept (image 151655, audio 151675, vision_start 151652, ...,
  `position_id_per_seconds` 13).
- `model.safetensors`: only the Thinker's tensors (`thinker.model.*`, `thinker.lm_head.weight`,
  `thinker.audio_tower.*`, `thinker.visual.*`, hub layout, bfloat16), from a random
  `Qwen3OmniMoeThinkerForConditionalGeneration`. `embed_tokens` and `lm_head` are zero outside an active id set S
  (ids 0..255 plus the chat and multimodal special ids), which keeps the file small once compressed.
- `reference.safetensors` and `reference.json`:
  * inputs, bfloat16 as they travel on the wire: `vision.pixel_values` `[patches, 1536]` of the items in
    reference.json `vision.grid_thw` (two images and one two-frame video), `audio.features.{k}` `[128, frames_k]`
    for reference.json `audio.frames`;
  * tower outputs, float32: `vision.merged` `[patches / 4, hidden]` and `vision.deepstack.{j}` (one encoder call over
    all three items), `audio.out.{k}` `[tokens_k, hidden]` (one call per clip);
  * requests (reference.json `requests`: an image, an audio clip, an image and a clip with text between, text
    only): `ids` with expanded placeholders, `items` (`modality`, `index` into the image or audio lists,
    `offset`, `len` of the placeholder run), `positions` `[3, T]` and `rope_delta` from `get_rope_index`,
    `greedy` (8 tokens of `generate`, greedy) and `min_greedy_margin`; `req.{i}.logits` `[T, |S|]` are the prompt's
    logits restricted to S (every other column is exactly 0; reference.json `logit_ids` lists S).

Every weight and input is exactly bfloat16-representable and every reference is computed in float32 on those values.

Run through `scripts/make-omni-mm-fixtures.sh`, which sets up the virtual environment.
"""

import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_omni_fixtures as base  # noqa: E402  (the shared tiny config and initialisation rules)
from fixture_util import (  # noqa: E402
    AUDIO,
    AUDIO_END,
    AUDIO_START,
    IMAGE,
    VIDEO,
    VISION_END,
    VISION_START,
    save_bf16_checked,
)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "crates", "omni-models", "tests", "fixtures", "qwen3-omni-mm")

MM_IDS = [IMAGE, VIDEO, AUDIO, VISION_START, VISION_END, AUDIO_START, AUDIO_END]
ACTIVE = sorted(set(range(256)) | set(base.SPECIAL_IDS) | set(MM_IDS))

# Two images and a two-frame video, encoded in one call (the video's frames attend separately).
GRIDS = [(1, 4, 6), (1, 10, 4), (2, 4, 4)]
# 537 frames: five full 100-frame chunks and a 37-frame tail (padded), 70 tokens over three attention windows of
# 26; 73 frames: one short chunk, 10 tokens.
AUDIO_FRAMES = [537, 73]
NEW_TOKENS = 8


def make_config():
    cfg = base.make_config()
    th = cfg.thinker_config
    a = th.audio_config
    a.encoder_layers, a.encoder_attention_heads, a.encoder_ffn_dim = 2, 2, 64
    a.d_model, a.output_dim, a.downsample_hidden_size = 32, 32, 8
    a.n_window, a.n_window_infer = 50, 200
    v = th.vision_config
    v.depth, v.hidden_size, v.intermediate_size, v.num_heads = 3, 32, 64, 2
    v.num_position_embeddings, v.out_hidden_size = 64, 32
    v.deepstack_visual_indexes = [0, 2]
    cfg.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    return cfg


def chat(gen, parts):
    """`<|im_start|>user\\n` + parts (ints: that many random text ids; lists: literal ids) + the assistant turn."""
    ids = [base.IM_START, base.USER, base.NEWLINE]
    for p in parts:
        ids += torch.randint(0, 256, (p,), generator=gen).tolist() if isinstance(p, int) else p
    return ids + [base.IM_END, base.NEWLINE, base.IM_START, base.ASSISTANT, base.NEWLINE]


def audio_tokens(frames):
    leave = frames % 100
    f = (leave - 1) // 2 + 1
    return ((f - 1) // 2 + 1 - 1) // 2 + 1 + (frames // 100) * 13


def main() -> int:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)

    cfg = make_config()
    model = Qwen3OmniMoeThinkerForConditionalGeneration(cfg.thinker_config).eval()
    holder = nn.Module()  # so that parameter names carry the checkpoint's `thinker.` prefix
    holder.thinker = model
    base.ACTIVE = ACTIVE
    base.randomize(holder, seed=77)

    with tempfile.TemporaryDirectory() as tmp:
        stored = save_bf16_checked(Qwen3OmniMoeThinkerForConditionalGeneration, cfg.thinker_config, model, tmp)
    save_file({f"thinker.{k}": v.contiguous() for k, v in stored.items()}, os.path.join(OUT, "model.safetensors"),
              metadata={"format": "pt"})
    cfg.dtype = torch.bfloat16
    cfg.to_json_file(os.path.join(OUT, "config.json"))

    gen = torch.Generator().manual_seed(5)
    out, ref = {}, {"logit_ids": ACTIVE, "vision.grid_thw": [list(g) for g in GRIDS], "audio.frames": AUDIO_FRAMES}

    # Towers.
    patches = sum(t * h * w for t, h, w in GRIDS)
    pixels = (torch.rand((patches, 1536), generator=gen) * 2 - 1).to(torch.bfloat16)
    out["vision.pixel_values"] = pixels
    grid = torch.tensor(GRIDS)
    with torch.no_grad():
        vis = model.model.visual(pixels.float(), grid_thw=grid)
    out["vision.merged"] = vis.pooler_output.contiguous()
    for j, d in enumerate(vis.deepstack_features):
        out[f"vision.deepstack.{j}"] = d.contiguous()
    clips = []
    for k, frames in enumerate(AUDIO_FRAMES):
        feats = (torch.randn((128, frames), generator=gen) * 0.5).to(torch.bfloat16)
        out[f"audio.features.{k}"] = feats
        clips.append(feats.float()[None])
        with torch.no_grad():
            a = model.model.get_audio_features(clips[-1], torch.ones((1, frames), dtype=torch.long))
        assert a.last_hidden_state.shape[0] == audio_tokens(frames), (a.last_hidden_state.shape, frames)
        out[f"audio.out.{k}"] = a.last_hidden_state.contiguous()

    # Requests: (image indexes, audio indexes, prompt parts).
    image_pixels, start = [], 0
    for t, h, w in GRIDS[:2]:
        image_pixels.append(pixels[start : start + t * h * w].float())
        start += t * h * w

    def img(i):
        t, h, w = GRIDS[i]
        return [VISION_START] + [IMAGE] * (t * h * w // 4) + [VISION_END]

    def aud(k):
        return [AUDIO_START] + [AUDIO] * audio_tokens(AUDIO_FRAMES[k]) + [AUDIO_END]

    specs = [
        ([0], [], [3, img(0), 4]),
        ([], [0], [2, aud(0), 5]),
        ([1], [1], [2, img(1), 6, aud(1), 3]),
        ([], [], [12]),
    ]
    requests, margins = [], []
    cols = torch.tensor(ACTIVE)
    outside = torch.ones(cfg.thinker_config.text_config.vocab_size, dtype=torch.bool)
    outside[cols] = False
    for r, (images, audios, parts) in enumerate(specs):
        ids = chat(gen, parts)
        x = torch.tensor([ids])
        kw = dict(input_ids=x, attention_mask=torch.ones_like(x))
        if images:
            kw["pixel_values"] = torch.cat([image_pixels[i] for i in images])
            kw["image_grid_thw"] = torch.tensor([GRIDS[i] for i in images])
        if audios:
            kw["input_features"] = torch.cat([clips[k] for k in audios])
            kw["feature_attention_mask"] = torch.ones((len(audios), AUDIO_FRAMES[audios[0]]), dtype=torch.long)
        items = []
        for modality, token, idx in [("image", IMAGE, images), ("audio", AUDIO, audios)]:
            run = [i for i, t in enumerate(ids) if t == token]
            if idx:
                assert run == list(range(run[0], run[0] + len(run))), "one placeholder run per modality"
                items.append(dict(modality=modality, index=idx[0], offset=run[0], len=len(run)))
        items.sort(key=lambda it: it["offset"])
        pos, delta = model.get_rope_index(
            x,
            kw.get("image_grid_thw"),
            None,
            kw["attention_mask"],
            False,
            torch.tensor([AUDIO_FRAMES[k] for k in audios]) if audios else None,
            None,
        )
        with torch.no_grad():
            logits = model(**kw).logits[0]
        assert torch.all(logits[:, outside] == 0), "logits outside the active set must be exactly 0"
        out[f"req.{r}.logits"] = logits[:, cols].contiguous()
        g = model.generate(
            **kw, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=base.IM_END, output_scores=True,
            return_dict_in_generate=True,
        )
        new = g.sequences[0, len(ids) :].tolist()
        assert new[0] == int(logits[-1].argmax()), (new, int(logits[-1].argmax()))
        m = min(base.top2_margin(s) for s in g.scores)
        margins.append(m)
        requests.append(
            dict(
                ids=ids,
                items=items,
                positions=pos[:, 0, :].long().tolist(),
                rope_delta=int(delta.reshape(-1)[0]),
                greedy=new,
                min_greedy_margin=m,
            )
        )
    ref["requests"] = requests
    ref["min_greedy_margin"] = min(margins)

    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(OUT, "reference.safetensors"))
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(ref, f, separators=(",", ":"))
        f.write("\n")
    for name in sorted(os.listdir(OUT)):
        print(f"{name}: {os.path.getsize(os.path.join(OUT, name))} bytes")
    print("min greedy margin", ref["min_greedy_margin"], "tokens", [len(q["ids"]) for q in requests])
    return 0


if __name__ == "__main__":
    sys.exit(main())
