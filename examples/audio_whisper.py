"""A speech-to-text handler as one is written for Hugging Face Whisper: feature extractor and model loaded
once; collate decodes each item's 16 kHz mono WAV bytes (stdlib wave + numpy, ahead of the model) into log-mel
features; the batch runs generate() and returns each clip's token ids, a [B, <= 1 + MAX_NEW_TOKENS] tensor.
The model folder is AUDIO_MODEL_DIR (default ./whisper-model), built by examples/make_media.py.

    python calque.py pool create --model whisper --handler examples/audio_whisper.py:Transcribe --workers 2
    python calque.py submit --pool whisper clips/ --id-field path
"""
import io
import os
import wave

import numpy as np
import torch
from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

import calque

MAX_NEW_TOKENS = 8   # tokens generated per clip


def samples(data):
    """A 16-bit mono WAV's samples as float32 in [-1, 1]. A WAV cut short raises EOFError saying where."""
    try:
        w = wave.open(io.BytesIO(data))
    except EOFError:   # wave's own says nothing
        raise EOFError(f"WAV truncated in its header ({len(data)} bytes)") from None
    with w:
        if (w.getnchannels(), w.getsampwidth()) != (1, 2):
            raise ValueError(f"WAV of {w.getnchannels()} channel(s), {8 * w.getsampwidth()}-bit: want mono 16-bit")
        frames, want = w.readframes(w.getnframes()), w.getnframes()
    if len(frames) < 2 * want:
        raise EOFError(f"WAV truncated: {len(frames) // 2} of the {want} frames its header says")
    return np.frombuffer(frames, "<i2").astype(np.float32) / 32768


class Transcribe:
    @calque.enter
    def load(self):
        folder = os.environ.get("AUDIO_MODEL_DIR", "whisper-model")
        if not os.path.isdir(folder):   # else transformers would take the name for a model on the Hugging Face hub
            raise FileNotFoundError(f"no model folder {os.path.abspath(folder)}: build it with "
                                    f"examples/make_media.py, or set AUDIO_MODEL_DIR")
        self.features = WhisperFeatureExtractor.from_pretrained(folder)
        self.model = WhisperForConditionalGeneration.from_pretrained(folder).eval()

    def collate(self, items):
        """[B, 80, frames] log-mel features (each clip padded or cut to the extractor's chunk)."""
        audio = [samples(item["bytes"] if "bytes" in item else item["audio"]["bytes"]) for item in items]
        return self.features(audio, sampling_rate=self.features.sampling_rate, return_tensors="pt")["input_features"]

    @calque.batch
    def transcribe(self, input_features):
        with torch.inference_mode():
            return self.model.generate(input_features, max_new_tokens=MAX_NEW_TOKENS)
