"""Helpers the Qwen3-Omni fixture scripts share (`make_omni_fixtures.py`, `make_omni_mm_fixtures.py`,
`make_mm_golden.py`): the real checkpoint's token ids and the bfloat16 save-and-reload check.

Imported from the scripts' own folder (a script's folder is first on `sys.path`).
"""

import os

import torch
from safetensors.torch import load_file

# Real Qwen3-Omni-30B-A3B token ids: chat and TTS.
IM_START, IM_END, NEWLINE = 151644, 151645, 198
SYSTEM, USER, ASSISTANT = 8948, 872, 77091
TTS_PAD, TTS_BOS, TTS_EOS = 151671, 151672, 151673
SPECIAL_IDS = [NEWLINE, SYSTEM, USER, ASSISTANT, IM_START, IM_END, TTS_PAD, TTS_BOS, TTS_EOS]

# Multimodal placeholders and their delimiters.
IMAGE, VIDEO, AUDIO = 151655, 151656, 151675
VISION_START, VISION_END, AUDIO_START, AUDIO_END = 151652, 151653, 151669, 151670
# The same ids under their config names, in the order the golden files list them.
MM_TOKEN_IDS = dict(
    image_token_id=IMAGE,
    video_token_id=VIDEO,
    audio_token_id=AUDIO,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
    audio_start_token_id=AUDIO_START,
    audio_end_token_id=AUDIO_END,
)


def save_bf16_checked(model_cls, config, model, directory, set_config_dtype=False):
    """Save `model` (exactly bfloat16-representable weights) as bfloat16 through `model_cls(config).save_pretrained`
    into `directory`, check that the file loads back in float32 to exactly `model`'s weights, and return the stored
    tensors of `model.safetensors` (all bfloat16). With `set_config_dtype` the saved config says bfloat16 too."""
    saved = model_cls(config).eval()
    saved.load_state_dict(model.state_dict())
    saved = saved.to(torch.bfloat16)
    if set_config_dtype:
        saved.config.dtype = torch.bfloat16
    saved.save_pretrained(directory)
    del saved
    reloaded = model_cls.from_pretrained(directory, dtype=torch.float32)
    want, got = model.state_dict(), reloaded.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    del reloaded
    stored = load_file(os.path.join(directory, "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    return stored
