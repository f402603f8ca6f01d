#!/usr/bin/env python3
"""Writes bench/models/qwen3-omni-30b-a3b/config.json: Qwen3-Omni-30B-A3B-Instruct's real sizes
and ids (shared/design/omni.md section 1), for `--load-format dummy` runs at the real shapes.

transformers checks the config by building the model on the meta device; the parameter count
must equal the real checkpoint's (35,259,818,545). Run with scripts/.venv/bin/python (see
scripts/make-omni-fixtures.sh for the environment).
"""

import json
import os

import torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "bench", "models", "qwen3-omni-30b-a3b")

MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20], "interleaved": True}

thinker_text = dict(
    vocab_size=152064, hidden_size=2048, intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, hidden_act="silu",
    max_position_embeddings=65536, rms_norm_eps=1e-6, rope_parameters=MROPE, attention_bias=False,
    decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
    norm_topk_prob=True, mlp_only_layers=[],
)
audio = dict(
    num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
    d_model=1280, output_dim=2048, n_window=50, n_window_infer=800, conv_chunksize=500,
    downsample_hidden_size=480, max_source_positions=1500,
)
vision = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)
thinker = dict(
    text_config=thinker_text, audio_config=audio, vision_config=vision,
    audio_token_id=151675, image_token_id=151655, video_token_id=151656,
    audio_start_token_id=151669, audio_end_token_id=151670, vision_start_token_id=151652,
    vision_end_token_id=151653, user_token_id=872, position_id_per_seconds=13,
    tie_word_embeddings=False,
)
talker_text = dict(
    vocab_size=3072, hidden_size=1024, intermediate_size=2048, num_hidden_layers=20,
    num_attention_heads=16, num_key_value_heads=2, head_dim=128, hidden_act="silu",
    max_position_embeddings=65536, rms_norm_eps=1e-6, rope_parameters=MROPE, attention_bias=False,
    decoder_sparse_step=1, moe_intermediate_size=384, num_experts_per_tok=6, num_experts=128,
    shared_expert_intermediate_size=768, norm_topk_prob=True, mlp_only_layers=[],
)
code_predictor = dict(
    vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_act="silu",
    max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, num_code_groups=16,
    layer_types=["full_attention"] * 5,
)
talker = dict(
    text_config=talker_text, code_predictor_config=code_predictor, accept_hidden_layer=24,
    thinker_hidden_size=2048, num_code_groups=16, codec_pad_id=2148, codec_bos_id=2149,
    codec_eos_token_id=2150, codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
    speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303}, position_id_per_seconds=13,
    audio_token_id=151675, image_token_id=151655, video_token_id=151656,
    vision_start_token_id=151652, audio_start_token_id=151669, spatial_merge_size=2,
)
code2wav = dict(
    codebook_size=2048, hidden_size=1024, max_position_embeddings=8000,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_attention_heads=16,
    num_key_value_heads=16, attention_bias=False, sliding_window=72, intermediate_size=3072,
    hidden_act="silu", layer_scale_initial_scale=0.01, rms_norm_eps=1e-5, num_hidden_layers=8,
    num_quantizers=16, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=1536,
)
config = Qwen3OmniMoeConfig(
    thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
    enable_audio_output=True, im_start_token_id=151644, im_end_token_id=151645,
    tts_pad_token_id=151671, tts_bos_token_id=151672, tts_eos_token_id=151673,
    system_token_id=8948, user_token_id=872, assistant_token_id=77091,
)
config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
config.dtype = "bfloat16"
with torch.device("meta"):
    model = Qwen3OmniMoeForConditionalGeneration(config)
total = sum(p.numel() for p in model.parameters())
parts = {n: sum(p.numel() for p in m.parameters()) for n, m in
         [("thinker", model.thinker), ("talker", model.talker), ("code2wav", model.code2wav)]}
print("parameters:", total, parts)
assert total == 35_259_818_545, total
os.makedirs(OUT, exist_ok=True)
d = config.to_dict()
with open(os.path.join(OUT, "config.json"), "w") as f:
    json.dump(d, f, indent=2, sort_keys=True)
    f.write("\n")
print("wrote", os.path.join(OUT, "config.json"))
