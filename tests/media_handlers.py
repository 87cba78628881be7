"""Handlers of the media tests, written as a user's would be: collate decodes each item's bytes (a file's
{"path", "bytes"}, or a Hugging Face Image column's struct) with Pillow or wave (test_media_in.py); Generate
returns media bytes (test_media_out.py)."""
import hashlib
import io
import os
import time
import wave

import calque


def media(item):
    """The bytes an item carries, and its name: a file's, or an HF Image struct column's."""
    if "bytes" in item:
        return item["bytes"], item["path"]
    return item["image"]["bytes"], item["image"]["path"]


def decode(data):
    """What media bytes hold: an image's [H, W, C], a WAV's [frames], None for no bytes at all. A corrupt
    file raises the decoder's own error; a WAV shorter than its header says raises EOFError."""
    if not data:
        return None
    if data[:4] == b"RIFF":
        with wave.open(io.BytesIO(data)) as w:
            frames, want = w.readframes(w.getnframes()), w.getnframes() * w.getsampwidth() * w.getnchannels()
        if len(frames) < want:
            raise EOFError(f"WAV truncated: {len(frames)} of {want} bytes of frames")
        return [w.getnframes()]
    import numpy as np
    from PIL import Image
    return list(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).shape)


class Decode:
    """collate decodes every item (in the pipeline, beside the model); the batch returns what each held. With
    $GATE_DIR, the first batch of a process announces itself (started-<pid>) and waits for $GATE_DIR/open."""

    @calque.enter
    def load(self):
        self.gate = os.environ.get("GATE_DIR")

    def collate(self, items):
        out = []
        for item in items:
            data, name = media(item)
            out.append({"name": name, "type": type(data).__name__, "shape": decode(data),
                        "sha": hashlib.sha256(data or b"").hexdigest()[:16], "size": len(data or b"")})
        time.sleep(float(os.environ.get("COLLATE_SLEEP", "0")))   # a slow decoder that releases the GIL
        return out

    @calque.batch
    def run(self, batch):
        if self.gate:
            with open(os.path.join(self.gate, f"started-{os.getpid()}"), "w") as f:
                f.write(str(len(batch)))
            while not os.path.exists(os.path.join(self.gate, "open")):
                time.sleep(0.02)
        return batch


class Kinds:
    """No collate: the batch receives the items themselves; returns each value's type, nested one level."""

    @calque.enter
    def load(self):
        pass

    @calque.batch
    def run(self, items):
        def kind(v):
            if isinstance(v, dict):
                return {k: kind(x) for k, x in v.items()}
            if isinstance(v, list):
                return [kind(x) for x in v]
            return [type(v).__name__, len(v)] if isinstance(v, bytes) else type(v).__name__
        return [kind(item) for item in items]


def png(color):
    """A 4x4 PNG of one colour."""
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), tuple(color)).save(buf, "PNG")
    return buf.getvalue()


def wav(frames):
    """A 16 kHz mono WAV of `frames` frames of silence."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(bytes(2 * frames))
    return buf.getvalue()


class Generate:
    """Media out, as an image or audio generator returns it. Items {"color", "frames"}: a batch-shaped dict,
    {"png": [B PNGs], "wav": [B WAVs], "label": [B texts]}; items {"blob": hex}: a batch-shaped list of those
    bytes, bare. An item with "fail" raises (it fails alone)."""

    @calque.enter
    def load(self):
        pass

    @calque.batch
    def run(self, items):
        if any("fail" in item for item in items):
            raise ValueError("asked to fail")
        if all("blob" in item for item in items):
            return [bytes.fromhex(item["blob"]) for item in items]
        return {"png": [png(item["color"]) for item in items], "wav": [wav(item["frames"]) for item in items],
                "label": [f"{item['frames']} frames" for item in items]}
