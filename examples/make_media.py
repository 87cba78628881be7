"""Build the media examples' models and media on this machine, nothing downloaded: a small ViT and its image
processor (examples/image_embed.py), a tiny Whisper and its feature extractor (examples/audio_whisper.py), both
with random weights; JPEGs of varied content and sizes, 16 kHz mono WAVs, and the JPEGs again as a Parquet file
with an Image column as Hugging Face `datasets` writes one (image: struct<bytes: binary, path: string>).

    .venv/bin/pip install -r examples/requirements-media.txt
    .venv/bin/python examples/make_media.py .                      # ./vit-model ./whisper-model ./photos ./clips
    .venv/bin/python examples/make_media.py . --images 300 --size 224 --clips 40
"""
import argparse
import io
import os
import wave

import numpy as np

# ------------------------------------------------------------------------------------------------
RATE = 16000          # Hz: the sampling rate Whisper's feature extractor expects
CHUNK_SECONDS = 5     # s of audio the feature extractor pads or cuts to (a real Whisper: 30; 5 keeps it small)
ROW_GROUP = 100       # Parquet rows per row group, as `datasets` writes an Image column
# ------------------------------------------------------------------------------------------------


def build_image_model(folder, seed=0):
    """A ViT (4 layers x 192, patches of 16 on 224x224) with random weights, and its image processor."""
    import torch
    from transformers import ViTConfig, ViTImageProcessorPil, ViTModel
    torch.manual_seed(seed)
    config = ViTConfig(image_size=224, patch_size=16, hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
                       intermediate_size=768)
    ViTModel(config).eval().save_pretrained(folder, safe_serialization=True)
    ViTImageProcessorPil(size={"height": 224, "width": 224}).save_pretrained(folder)   # Pillow: no torchvision


def build_audio_model(folder, seed=0):
    """A WhisperForConditionalGeneration of d_model 64, 2+2 layers, a 64-token vocabulary, random weights, and
    a WhisperFeatureExtractor (80 log-mel bins) cutting audio at CHUNK_SECONDS."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration
    torch.manual_seed(seed)
    frames = CHUNK_SECONDS * RATE // 160   # the extractor's hop: 160 samples; the encoder's conv halves them
    config = WhisperConfig(vocab_size=64, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
                           max_source_positions=frames // 2, max_target_positions=32, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None,
                           begin_suppress_tokens=None, init_std=0.2)   # 0.2: clips give different tokens
    WhisperForConditionalGeneration(config).eval().save_pretrained(folder, safe_serialization=True)
    WhisperFeatureExtractor(feature_size=80, sampling_rate=RATE, chunk_length=CHUNK_SECONDS).save_pretrained(folder)


def photo(width, height, seed, quality=90):
    """A JPEG of a smooth colour field, a few shapes and sensor noise: as many bytes as a photo of its size."""
    from PIL import Image, ImageDraw
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    field = np.stack([np.sin(x * rng.uniform(1, 12) + y * rng.uniform(1, 12) + rng.uniform(0, 6)) for _ in "rgb"],
                     -1)
    pixels = (127 + 100 * field + rng.normal(0, 12, (height, width, 3))).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.integers(2, 8)):
        box = sorted(rng.integers(0, width, 2)), sorted(rng.integers(0, height, 2))
        draw.ellipse([box[0][0], box[1][0], box[0][1], box[1][1]], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def clip(seconds, seed):
    """A 16-bit mono WAV at RATE: a few tones that glide, and noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    sound = sum(np.sin(2 * np.pi * rng.uniform(100, 2000) * t * (1 + rng.uniform(-0.2, 0.2) * t)) for _ in range(3))
    samples = (3000 * sound + rng.normal(0, 300, t.size)).clip(-32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(samples.tobytes())
    return buf.getvalue()


def write_photos(folder, count, size=None, seed=0):
    """`count` JPEGs in `folder` (photo-00000.jpg...): size x size, or of varied sizes 96-480 a side."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for k in range(count):
        width, height = (size, size) if size else rng.integers(96, 481, 2)
        with open(os.path.join(folder, f"photo-{k:05d}.jpg"), "wb") as f:
            f.write(photo(int(width), int(height), seed + k))


def write_clips(folder, count, seed=0):
    """`count` WAVs of 0.5-3 s in `folder` (clip-00000.wav...)."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for k in range(count):
        with open(os.path.join(folder, f"clip-{k:05d}.wav"), "wb") as f:
            f.write(clip(rng.uniform(0.5, 3), seed + k))


def write_image_parquet(path, folder):
    """The files of `folder` (sorted) as a Parquet Image column, a row group at a time (memory: one group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", image)])
    names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, len(names), ROW_GROUP):
            rows = []
            for name in names[start:start + ROW_GROUP]:
                with open(os.path.join(folder, name), "rb") as f:
                    rows.append({"bytes": f.read(), "path": name})
            writer.write_table(pa.table({"image": pa.array(rows, image)}, schema))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="where to write vit-model/, whisper-model/, photos/, clips/, images.parquet")
    parser.add_argument("--images", type=int, default=200, help="JPEGs to write (default 200)")
    parser.add_argument("--size", type=int, help="their side in pixels (default: varied, 96-480)")
    parser.add_argument("--clips", type=int, default=20, help="WAVs to write (default 20)")
    args = parser.parse_args()
    out = lambda name: os.path.join(args.folder, name)   # noqa: E731
    if not os.path.exists(out("vit-model/model.safetensors")):
        build_image_model(out("vit-model"))
    if not os.path.exists(out("whisper-model/model.safetensors")):
        build_audio_model(out("whisper-model"))
    write_photos(out("photos"), args.images, args.size)
    write_clips(out("clips"), args.clips)
    write_image_parquet(out("images.parquet"), out("photos"))
    print(f"models in {out('vit-model')} and {out('whisper-model')}; {args.images} JPEGs in {out('photos')}, "
          f"{args.clips} WAVs in {out('clips')}, the JPEGs as an Image column in {out('images.parquet')}")
