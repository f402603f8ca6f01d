#!/usr/bin/env python3
"""Synthetic media and transformers reference outputs for the omni-mm tests.

Writes `crates/omni-mm/tests/fixtures/`:

- inputs it generates (seeded): `img_1280x720.png` (the smart_resize ties-even case), `img_20x20.png`
  (upscale branch), `img_big.png` (3840x3456, over max_pixels: the downscale branch), `img_rgba.png`
  (alpha), `img_q90.jpg`, `img_lossy.webp`, `img_lossless.webp`, `frame_{0,1,2}.png` (a 3-frame video,
  1280x720, over the video max_pixels), `clip_160037.wav` (16 kHz PCM16, 160000 + 37 samples),
  `tone_44k1_stereo.flac` (2 s), `tone_44k1.mp3` (1 s, LAME through libsndfile).
- `golden.json`: per case the shapes, `grid_thw`, the blake3 of the f32 little-endian bytes of
  transformers' output, and a few rows; the M-RoPE / placeholder vectors; the reports (fast vs slow
  image processor, torch vs numpy mel path, scipy vs soxr resampling, PIL's decodes).
- raw little-endian f32 arrays (`*.f32`): the log-mel of the 160037-sample clip `[128, 1000]`, the
  resampled FLAC clip (scipy `resample_poly` and soxr_hq), the MP3 decoded by libsndfile, and PIL's
  decodes of the lossy JPEG / WebP files and the vLLM-style RGB of the RGBA file as u8 (`*.u8`).

References are built from explicit arguments (no hub): `Qwen2VLImageProcessorPil(patch_size=16,
temporal_patch_size=2, merge_size=2, min_pixels=3136, max_pixels=12845056, image_mean/std 0.5)`,
`WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400,
chunk_length=300)` called with the Qwen3-Omni processor's audio kwargs, and
`Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_rope_index` on a stand-in object that carries
the checkpoint's thinker ids (`position_id_per_seconds=13`).

Run through `scripts/make-mm-golden.sh`, which sets up the virtual environment.
"""

import io
import json
import types
from pathlib import Path

import blake3
import numpy as np
import soundfile as sf
import torch
from PIL import Image
from scipy import signal

import soxr
from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qom
from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe as qop

from fixture_util import MM_TOKEN_IDS

OUT = Path(__file__).resolve().parent.parent / "crates" / "omni-mm" / "tests" / "fixtures"
RNG = np.random.default_rng(20261214)
IDS = MM_TOKEN_IDS
IMG_KW = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    min_pixels=3136,
    max_pixels=12845056,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)
VIDEO_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}


def b3(a: np.ndarray) -> str:
    return blake3.blake3(np.ascontiguousarray(a, dtype="<f4").tobytes()).hexdigest()


def save_f32(name: str, a: np.ndarray) -> None:
    (OUT / name).write_bytes(np.ascontiguousarray(a, dtype="<f4").tobytes())


def blocks(h: int, w: int, bh: int, bw: int, noise_box: int = 0) -> np.ndarray:
    """Random colour blocks (sharp edges at every phase, cheap to store) plus a noise square."""
    gh, gw = -(-h // bh), -(-w // bw)
    cells = RNG.integers(0, 256, size=(gh, gw, 3), dtype=np.uint8)
    img = np.repeat(np.repeat(cells, bh, axis=0), bw, axis=1)[:h, :w].copy()
    if noise_box:
        n = min(noise_box, h, w)
        img[:n, :n] = RNG.integers(0, 256, size=(n, n, 3), dtype=np.uint8)
    return img


def save_png(name: str, arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", optimize=True)
    (OUT / name).write_bytes(buf.getvalue())
    return buf.getvalue()


def image_case(proc, name: str, pil: Image.Image, fast=None) -> dict:
    out = proc(images=[pil], return_tensors="np")
    pv = np.asarray(out["pixel_values"], dtype=np.float32)
    grid = [int(x) for x in out["image_grid_thw"][0]]
    case = {
        "file": name,
        "grid_thw": grid,
        "shape": list(pv.shape),
        "blake3": b3(pv),
        "row_last": pv[-1].tolist(),
        "sum": float(pv.astype(np.float64).sum()),
    }
    if fast is not None:
        fo = fast(images=[pil], return_tensors="pt")
        fpv = fo["pixel_values"].numpy().astype(np.float32)
        if fpv.shape == pv.shape:
            d = np.abs(fpv - pv)
            case["fast_vs_slow"] = {
                "max_abs": float(d.max()),
                "mean_abs": float(d.mean()),
                "frac_differing": float((d > 1e-6).mean()),
                "max_u8_levels": float(d.max() / (2.0 / 255.0)),
            }
    return case


def images(golden: dict) -> None:
    proc = Qwen2VLImageProcessorPil(**IMG_KW)
    try:
        from transformers import Qwen2VLImageProcessor

        fast = Qwen2VLImageProcessor(**IMG_KW)
    except Exception as e:  # torchvision missing
        print("fast image processor unavailable:", e)
        fast = None
    cases = {}
    a = blocks(720, 1280, 9, 7, noise_box=160)
    save_png("img_1280x720.png", a)
    cases["img_1280x720"] = image_case(proc, "img_1280x720.png", Image.fromarray(a), fast)
    a = RNG.integers(0, 256, size=(20, 20, 3), dtype=np.uint8)
    save_png("img_20x20.png", a)
    cases["img_20x20"] = image_case(proc, "img_20x20.png", Image.fromarray(a), fast)
    a = blocks(3456, 3840, 29, 37, noise_box=64)
    save_png("img_big.png", a)
    cases["img_big"] = image_case(proc, "img_big.png", Image.fromarray(a), None)
    golden["images"] = cases

    # Alpha: vLLM's rgba_to_rgb (paste on white with the alpha as mask), then the processor.
    rgba = blocks(48, 64, 5, 3)
    alpha = RNG.integers(0, 256, size=(48, 64, 1), dtype=np.uint8)
    rgba = np.concatenate([rgba, alpha], axis=2)
    save_png("img_rgba.png", rgba)
    im = Image.open(OUT / "img_rgba.png")
    rgb = Image.new("RGB", im.size, (255, 255, 255))
    rgb.paste(im, mask=im.split()[3])
    (OUT / "img_rgba.rgb.u8").write_bytes(np.asarray(rgb).tobytes())

    # Lossy codecs: PIL's decodes, to measure our decoders against.
    src = blocks(120, 160, 6, 5, noise_box=40)
    Image.fromarray(src).save(OUT / "img_q90.jpg", quality=90)
    Image.fromarray(src).save(OUT / "img_lossy.webp", quality=80)
    Image.fromarray(src).save(OUT / "img_lossless.webp", lossless=True)
    for f in ["img_q90.jpg", "img_lossy.webp"]:
        dec = np.asarray(Image.open(OUT / f).convert("RGB"))
        (OUT / (f + ".rgb.u8")).write_bytes(dec.tobytes())
    golden["lossless_webp_rgb_blake3"] = blake3.blake3(src.tobytes()).hexdigest()


def video(golden: dict) -> None:
    """A 3-frame 1280x720 video: the PIL path per frame (our method) and the torchvision video processor."""
    base = blocks(720, 1280, 12, 10)
    frames = []
    for k in range(3):
        f = np.roll(base, shift=7 * k, axis=1)
        save_png(f"frame_{k}.png", f)
        frames.append(f)
    slow = Qwen2VLImageProcessorPil(**{**IMG_KW, "min_pixels": VIDEO_SIZE["shortest_edge"],
                                       "max_pixels": VIDEO_SIZE["longest_edge"]})
    # The slow image processor per frame + the video patch layout (pad to even by repeating the last).
    per = []
    for f in frames + [frames[-1]]:
        o = slow(images=[Image.fromarray(f)], return_tensors="np")
        grid = o["image_grid_thw"][0]
        per.append(np.asarray(o["pixel_values"], np.float32))
    gh, gw = int(grid[1]), int(grid[2])
    # Undo the image layout to [C, H, W] planes of one frame (rows are t-duplicated).
    def planes(pv):
        x = pv.reshape(gh // 2, gw // 2, 2, 2, 3, 2, 16, 16)[:, :, :, :, :, 0]
        return x.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * 16, gw * 16)
    vid = np.stack([planes(p) for p in per])  # [T, C, H, W]
    gt = vid.shape[0] // 2
    x = vid.reshape(gt, 2, 3, gh // 2, 2, 16, gw // 2, 2, 16).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pv = x.reshape(gt * gh * gw, 3 * 2 * 16 * 16)
    case = {"files": [f"frame_{k}.png" for k in range(3)], "grid_thw": [gt, gh, gw],
            "shape": list(pv.shape), "blake3": b3(pv), "row_last": pv[-1].tolist()}
    try:
        from transformers import Qwen2VLVideoProcessor

        vp = Qwen2VLVideoProcessor(**{k: v for k, v in IMG_KW.items() if k not in ("min_pixels", "max_pixels")},
                                   size=VIDEO_SIZE)
        vo = vp(videos=[np.stack(frames)], return_tensors="pt", do_sample_frames=False,
                cap_pixels_per_frame=False)
        vpv = vo["pixel_values_videos"].numpy()
        case["hf_video_processor_grid_thw"] = [int(v) for v in vo["video_grid_thw"][0]]
        if vpv.shape == pv.shape:
            d = np.abs(vpv - pv)
            case["hf_video_processor_vs_pil"] = {"max_abs": float(d.max()), "mean_abs": float(d.mean()),
                                                 "frac_differing": float((d > 1e-6).mean())}
    except Exception as e:
        print("video processor unavailable:", e)
    golden["video"] = case


def audio(golden: dict) -> None:
    n = 160000 + 37
    t = np.arange(n) / 16000.0
    x = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 3100 * t * (1 + 0.1 * t)) \
        + 0.05 * RNG.standard_normal(n)
    x[40000:48000] *= 0.001  # a quiet stretch (the max - 8 floor matters there)
    sf.write(OUT / "clip_160037.wav", x.astype(np.float32), 16000, subtype="PCM_16")
    wav, sr = sf.read(OUT / "clip_160037.wav", dtype="float32")
    assert sr == 16000 and wav.shape == (n,)
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400,
                                 chunk_length=300, padding_value=0.0, dither=0.0, return_attention_mask=True)
    # The Qwen3-Omni processor's audio kwargs.
    out = fe(wav, sampling_rate=16000, padding=True, truncation=False, return_attention_mask=True,
             return_tensors="np")
    feats = np.asarray(out["input_features"][0], np.float32)
    mask = np.asarray(out["attention_mask"][0])
    save_f32("clip_160037.mel.f32", feats)
    npy = fe._np_extract_fbank_features(wav[None].astype(np.float32), "cpu")[0]
    golden["mel"] = {
        "file": "clip_160037.wav",
        "samples": n,
        "shape": list(feats.shape),
        "mask_sum": int(mask.sum()),
        "audio_tokens": int(qop._get_feat_extract_output_lengths(np.array(mask.sum()))),
        "torch_vs_numpy_path_max_abs": float(np.abs(npy - feats).max()),
    }

    # Decode + resample: a 2 s stereo 44.1 kHz FLAC.
    m = 88200
    t = np.arange(m) / 44100.0
    left = 0.4 * np.sin(2 * np.pi * 523.25 * t) + 0.1 * np.sin(2 * np.pi * 7000 * t)
    right = 0.3 * np.sin(2 * np.pi * 659.25 * t + 0.3) + 0.05 * np.sin(2 * np.pi * 10500 * t)
    st = np.stack([left, right], axis=1).astype(np.float32)
    sf.write(OUT / "tone_44k1_stereo.flac", st, 44100, subtype="PCM_16")
    dec, sr = sf.read(OUT / "tone_44k1_stereo.flac", dtype="float32", always_2d=True)
    mono = np.mean(dec.T, axis=0)  # librosa.to_mono
    scipy_y = signal.resample_poly(mono, 160, 441)
    soxr_y = soxr.resample(mono, 44100, 16000, quality="HQ")  # librosa.resample's default soxr_hq
    save_f32("tone.resample_poly.f32", scipy_y)
    save_f32("tone.soxr_hq.f32", soxr_y)
    k = min(len(scipy_y), len(soxr_y))
    golden["resample"] = {
        "file": "tone_44k1_stereo.flac",
        "decoded_frames": int(dec.shape[0]),
        "mono_blake3": b3(mono),
        "resample_poly_len": len(scipy_y),
        "soxr_len": len(soxr_y),
        "scipy_vs_soxr_max_abs": float(np.abs(scipy_y[:k] - soxr_y[:k]).max()),
        "scipy_vs_soxr_max_abs_interior": float(np.abs(scipy_y[200:k - 200] - soxr_y[200:k - 200]).max()),
    }

    # MP3 through libsndfile (LAME); its mpg123 decode is what librosa (soundfile) gives vLLM.
    m = 44100
    t = np.arange(m) / 44100.0
    y = (0.5 * np.sin(2 * np.pi * 330 * t) * np.minimum(1, t * 20)).astype(np.float32)
    sf.write(OUT / "tone_44k1.mp3", y, 44100, format="MP3")
    dec, sr = sf.read(OUT / "tone_44k1.mp3", dtype="float32")
    save_f32("tone_44k1.mp3.sndfile.f32", dec)
    golden["mp3"] = {"file": "tone_44k1.mp3", "sample_rate": sr, "sndfile_frames": int(dec.shape[0])}


def rope(golden: dict) -> None:
    cfg = types.SimpleNamespace(position_id_per_seconds=13, audio_config=types.SimpleNamespace(n_window=50), **IDS)

    class StandIn:
        spatial_merge_size = 2
        config = cfg
        get_rope_index = qom.Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_rope_index
        get_llm_pos_ids_for_vision = qom.Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_llm_pos_ids_for_vision

    model = StandIn()
    I, V, A = IDS["image_token_id"], IDS["video_token_id"], IDS["audio_token_id"]
    VS, VE, AS, AE = (IDS[k] for k in ("vision_start_token_id", "vision_end_token_id",
                                       "audio_start_token_id", "audio_end_token_id"))

    # The processor's own interleaving for a video with audio (a stand-in self with token strings).
    def av_tokens(grid, spg, n_audio):
        stand = types.SimpleNamespace(audio_bos_token="<as>", audio_eos_token="<ae>", video_token="<v>",
                                      audio_token="<a>", video_processor=types.SimpleNamespace(merge_size=2))
        s = qop.Qwen3OmniMoeProcessor.replace_video_with_audio_token(
            stand, {"video_grid_thw": [np.array(grid)], "video_second_per_grid": [spg]}, 0,
            {"num_audio_tokens": [n_audio]}, 0, position_id_per_seconds=13)
        toks = s.replace("<as>", " AS ").replace("<ae>", " AE ").replace("<v>", " V ").replace("<a>", " A ").split()
        return [{"AS": AS, "AE": AE, "V": V, "A": A}[x] for x in toks]

    def tokens(grid):
        return int(np.prod(grid)) // 4

    cases = []
    specs = [
        ("image_audio_video", False, [
            ("text", [11, 12, 13]), ("image", [1, 44, 80]), ("text", [14, 15]), ("audio", 1037),
            ("text", [16]), ("video", [2, 16, 24], 2.0), ("text", [17, 18, 19])]),
        ("video_fps2_odd_frames", False, [("text", [1]), ("video", [2, 8, 12], 1.0), ("text", [2, 3])]),
        ("image_first_no_text", False, [("image", [1, 4, 6]), ("image", [1, 64, 2])]),
        ("audio_only", False, [("text", [5, 6]), ("audio", 250), ("text", [7])]),
        ("audio_in_video", True, [
            ("text", [21, 22]), ("image", [1, 8, 8]), ("text", [23]), ("av", [3, 8, 12], 2.0, 600),
            ("text", [24]), ("audio", 100), ("text", [25, 26])]),
        ("audio_in_video_long_audio", True, [("text", [1]), ("av", [2, 4, 4], 2.0, 1037), ("text", [2])]),
    ]
    for name, use_av, parts in specs:
        ids, short, items = [], [], []
        image_grids, video_grids, spgs, audio_lens = [], [], [], []
        for p in parts:
            kind = p[0]
            if kind == "text":
                ids += p[1]
                short += p[1]
            elif kind == "image":
                ids += [VS] + [I] * tokens(p[1]) + [VE]
                short += [VS, I, VE]
                image_grids.append(p[1])
                items.append({"image": {"grid_thw": p[1]}})
            elif kind == "video":
                ids += [VS] + [V] * tokens(p[1]) + [VE]
                short += [VS, V, VE]
                video_grids.append(p[1])
                spgs.append(p[2])
                items.append({"video": {"grid_thw": p[1], "second_per_grid": p[2]}})
            elif kind == "audio":
                n_tok = int(qop._get_feat_extract_output_lengths(np.array(p[1])))
                ids += [AS] + [A] * n_tok + [AE]
                short += [AS, A, AE]
                audio_lens.append(p[1])
                items.append({"audio": {"num_frames": p[1]}})
            elif kind == "av":
                n_tok = int(qop._get_feat_extract_output_lengths(np.array(p[3])))
                ids += [VS] + av_tokens(p[1], p[2], n_tok) + [VE]
                short += [VS, V, VE]
                video_grids.append(p[1])
                spgs.append(p[2])
                audio_lens.append(p[3])
                items.append({"video_with_audio": {"grid_thw": p[1], "second_per_grid": p[2], "audio_frames": p[3]}})
        # get_rope_index orders audios by their audio_start: for audio-in-video prompts the video's audio
        # comes where its block is, which is the prompt order used above.
        pos, delta = model.get_rope_index(
            input_ids=torch.tensor([ids]),
            image_grid_thw=torch.tensor(image_grids) if image_grids else None,
            video_grid_thw=torch.tensor(video_grids) if video_grids else None,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            use_audio_in_video=use_av,
            audio_seqlens=torch.tensor(audio_lens) if audio_lens else None,
            second_per_grids=torch.tensor(spgs) if spgs else None,
        )
        p = pos[:, 0, :].numpy()
        assert np.all(p == np.round(p)), name
        cases.append({"name": name, "ids": ids, "unexpanded_ids": short, "items": items,
                      "t": p[0].astype(int).tolist(), "h": p[1].astype(int).tolist(), "w": p[2].astype(int).tolist(),
                      "delta": int(delta.reshape(-1)[0])})
    golden["mrope"] = cases
    golden["ids"] = IDS


def bf16(golden: dict) -> None:
    vals = np.concatenate([
        RNG.standard_normal(4096).astype(np.float32),
        np.array([0.0, -0.0, 1.0, np.inf, -np.inf, 3.4028235e38, 1e-40, -1e-45], np.float32),
        np.frombuffer(np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F7FFFFF], np.uint32).tobytes(), np.float32),
    ])
    b = torch.from_numpy(vals).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16)
    save_f32("bf16.in.f32", vals)
    golden["bf16"] = {"file": "bf16.in.f32", "blake3_of_bf16_le": blake3.blake3(b.astype("<u2").tobytes()).hexdigest()}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    golden = {"transformers": __import__("transformers").__version__, "pillow": Image.__version__,
              "torch": torch.__version__}
    images(golden)
    video(golden)
    audio(golden)
    rope(golden)
    bf16(golden)
    (OUT / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    total = sum(f.stat().st_size for f in OUT.iterdir())
    print(f"wrote {OUT} ({total / 1e6:.2f} MB)")
    for k in ("images", "video"):
        print(k, json.dumps({n: {kk: v for kk, v in c.items() if kk in ("grid_thw", "fast_vs_slow", "hf_video_processor_vs_pil")}
                             for n, c in (golden[k].items() if k == "images" else [("video", golden[k])])}))
    print("mel", golden["mel"])
    print("resample", golden["resample"])
    print("mp3", golden["mp3"])


if __name__ == "__main__":
    main()
