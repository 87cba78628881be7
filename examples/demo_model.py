"""The bundled demo model: a small text classifier over hashed tokens, with real torch compute.

    python calque.py pool create --model demo --handler examples/demo_model.py:DemoModel --workers 2
    DEMO_MODEL_MB=400 DEMO_WARMUP_BATCHES=200 python warmd.py --model demo   # an expensive @enter

@enter writes a deterministic checkpoint on first use (seeded weights, torch.save of a plain state dict),
then loads it with torch.load(weights_only=True): the load a warm pool pays once per worker. Its cost
grows with DEMO_MODEL_MB (the checkpoint size) and DEMO_WARMUP_BATCHES (forward passes run once after
loading, as a real server warms its kernels).
"""
import os
import zlib

import torch

import calque

# ------------------------------------------------------------------------------------------------
# defaults, each an environment variable of the same name
DEMO_MODEL_MB = float(os.environ.get("DEMO_MODEL_MB", "16"))          # checkpoint size: the embedding table grows with it
DEMO_WARMUP_BATCHES = int(os.environ.get("DEMO_WARMUP_BATCHES", "0"))  # forward passes @enter runs after loading
DEMO_THREADS = int(os.environ.get("DEMO_THREADS", "1"))                # torch threads per worker (2 workers on 2 cores)
DEMO_CACHE = os.environ.get("DEMO_CACHE", os.path.join(os.environ.get("CALQUE_STATE", ".calque-state"), "demo-weights"))
DIM = 128               # embedding width
CLASSES = 4             # output labels
MAX_TOKENS = 512        # tokens kept per text


def tokenize(text, vocab):
    """Hashed word ids: stable across processes (crc32, not Python's salted hash)."""
    return [zlib.crc32(word.encode()) % vocab for word in text.lower().split()[:MAX_TOKENS]]


class TextClassifier(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(vocab, DIM, mode="mean")   # [vocab, DIM] holds nearly all the bytes
        self.hidden = torch.nn.Linear(DIM, DIM)
        self.out = torch.nn.Linear(DIM, CLASSES)

    def forward(self, ids, offsets):
        x = torch.tanh(self.hidden(self.embed(ids, offsets)))   # [B, DIM]
        return torch.softmax(self.out(x), dim=-1)               # [B, CLASSES]


class DemoModel:
    @calque.enter
    def load(self):
        torch.set_num_threads(DEMO_THREADS)
        self.vocab = max(1024, int(DEMO_MODEL_MB * 2**20 / (DIM * 4)))
        path = os.path.join(DEMO_CACHE, f"demo-{self.vocab}x{DIM}.pt")
        if not os.path.exists(path):
            torch.manual_seed(0)       # deterministic weights: every worker, every machine, same answers
            os.makedirs(DEMO_CACHE, exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}"
            torch.save(TextClassifier(self.vocab).state_dict(), tmp)
            os.replace(tmp, path)      # two workers may write it at once: the rename makes that harmless
        self.net = TextClassifier(self.vocab)
        self.net.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"))
        self.net.eval()
        warm = [{"text": f"warm up batch {i} " * 8} for i in range(32)]
        for _ in range(DEMO_WARMUP_BATCHES):
            self.predict(warm)

    @calque.batch
    def predict(self, items):
        ids, offsets = [], []
        for item in items:
            text = item["text"]
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"item has no text: {item!r}")
            offsets.append(len(ids))
            ids += tokenize(text, self.vocab)
        with torch.inference_mode():
            probs = self.net(torch.tensor(ids, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64))
        score, label = probs.max(dim=-1)
        return [{"label": int(l), "score": round(float(s), 6)} for l, s in zip(label, score)]
