"""Handlers the tests run in real warmd.py processes."""
import ctypes
import hashlib
import os
import signal
import threading
import time

import calque


class Echo:
    """Doubles x; an item with "fail" raises, so only that item fails. Its @enter builds a small table:
    tens of microseconds, so that the time a cold claim paid never rounds to 0 in its summary."""

    @calque.enter
    def load(self):
        self.loaded = dict.fromkeys(range(2000), True)

    @calque.batch
    def run(self, items):
        out = []
        for item in items:
            if item.get("fail"):
                raise ValueError(f"item {item['x']} asked to fail")
            out.append({"y": item["x"] * 2, "pid": os.getpid()})
        return out


class WrongCount:
    """Returns one result too few for every batch."""

    @calque.enter
    def load(self):
        pass

    @calque.batch
    def run(self, items):
        return [{"y": 1}] * (len(items) - 1)


class Gate:
    """Announces each batch in $GATE_DIR/started-<pid>, then holds it until $GATE_DIR/open exists:
    lets a test act on a worker that is provably mid-claim."""

    @calque.enter
    def load(self):
        pass

    @calque.batch
    def run(self, items):
        hold(items)
        return [{"y": item["x"] * 2, "pid": os.getpid()} for item in items]


def hold(items):
    """Announce the batch in $GATE_DIR/started-<pid>, then wait for $GATE_DIR/open."""
    gate = os.environ["GATE_DIR"]
    with open(os.path.join(gate, f"started-{os.getpid()}"), "w") as f:
        f.write(str(len(items)))
    while not os.path.exists(os.path.join(gate, "open")):
        time.sleep(0.01)


class Empty:
    """Does nothing: the benchmark of per-claim dispatch overhead."""

    @calque.enter
    def load(self):
        pass

    @calque.batch
    def run(self, items):
        return [None] * len(items)


class NoBatch:
    """Lacks @calque.batch: pool create must refuse it."""

    @calque.enter
    def load(self):
        pass

    def run(self, items):
        return items


class RowSum:
    """Numeric items: sums each item's fields. Receives fastbatch's collated dict of tensors (fixed
    fields stacked, ragged ones padded with <name>_lengths), or the list of dicts when not collated."""

    @calque.enter
    def load(self):
        pass

    @calque.batch
    def run(self, batch):
        if isinstance(batch, list):
            return [{k: float(v.sum()) for k, v in item.items()} for item in batch]
        names = [k for k in batch if not k.endswith("_lengths")]
        rows = len(batch[names[0]])
        return [{k: float(batch[k][i].sum()) for k in names} for i in range(rows)]


class Matmul:
    """Real compute on collated numeric input: a few [B, D] x [D, D] products per batch (the drain-loop
    overlap benchmark needs a model whose batch time exceeds its collation time)."""

    @calque.enter
    def load(self):
        import torch
        torch.set_num_threads(1)    # the other core is the prefetch thread's
        torch.manual_seed(0)
        dim = int(os.environ.get("MATMUL_DIM", "1024"))
        self.weight = torch.randn(dim, dim).to("cuda" if torch.cuda.is_available() else "cpu")   # where collation puts x
        self.repeats = int(os.environ.get("MATMUL_REPEATS", "4"))

    @calque.batch
    def run(self, batch):
        x = batch["input"]          # items from a .npy file arrive as {"input": row}
        for _ in range(self.repeats):
            x = (x @ self.weight).tanh()
        return x.sum(dim=1).tolist()


class Faulty:
    """Doubles x, and misbehaves on request, item by item: "die" ends the worker process ("exit": os._exit(3),
    "kill": os.kill of SIGKILL to itself, "libc-kill": the same through libc's kill(), "segv": a read of address 0);
    "hang" never returns; "nan" returns NaN; "deep": N returns a list nested N deep; "spin": N hashes N times first
    (real work, for kills to land mid-claim); with $GATE_DIR, "hold" announces the batch as Gate does and waits for
    $GATE_DIR/open. Appends "x pid" for every item it is called on to $CALLS_FILE when set. Has its own collate, so
    that a worker the supervisor restarts does not import torch."""

    @calque.enter
    def load(self):
        self.calls = os.environ.get("CALLS_FILE")

    @calque.batch
    def run(self, items):
        if self.calls:
            with open(self.calls, "a") as f:     # one append per call: whole lines even beside other workers
                f.write("".join(f"{item['x']} {os.getpid()}\n" for item in items))
        if any(item.get("hold") for item in items):
            hold(items)
        for item in items:
            digest = b""
            for _ in range(item.get("spin", 0)):
                digest = hashlib.sha256(digest).digest()
            if item.get("die") == "exit":
                os._exit(3)
            if item.get("die") == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if item.get("die") == "libc-kill":    # as native code would: warmd cannot see it coming
                ctypes.CDLL(None).kill(os.getpid(), signal.SIGKILL)
            if item.get("die") == "segv":
                ctypes.string_at(0)
            if item.get("hang"):
                threading.Event().wait()
        return [self.result(item) for item in items]

    @staticmethod
    def result(item):
        if item.get("nan"):
            return {"y": float("nan")}
        if item.get("deep"):
            nested = []
            for _ in range(item["deep"]):
                nested = [nested]
            return nested
        return {"y": item["x"] * 2}

    def collate(self, items):
        return items


class Timeline:
    """Counts each item's words (a model that costs next to nothing, so that the requests around it show), then
    waits $TIMELINE_MODEL_MS ms (0 by default: a model on an accelerator, whose host thread waits), and appends
    "pid start end first-id count" (time.time() around the call) per call to $TIMELINE_FILE: the model's timeline,
    which the latency bench reads the gaps between claims from."""

    @calque.enter
    def load(self):
        self.timeline = os.environ["TIMELINE_FILE"]
        self.wait = float(os.environ.get("TIMELINE_MODEL_MS", "0")) / 1000

    @calque.batch
    def run(self, items):
        start = time.time()
        out = [len(item["text"].split()) for item in items]
        time.sleep(self.wait)
        with open(self.timeline, "a") as f:     # one append per call: whole lines beside the other worker
            f.write(f"{os.getpid()} {start:.6f} {time.time():.6f} {items[0]['id']} {len(items)}\n")
        return out

    def collate(self, items):
        return items


class Typed:
    """Typed results, as each item's "shape" asks: "batch" (the batch's [B, 4] float32 array), "dict" ({"embedding":
    [B, 4], "label": [B] int64, "name": strings}), "short" (one row too few), "cuda" (the batch's torch tensor on a
    fake device: only .cpu() reaches its values), "bf16" (torch), "f16", "i64" (one array an item, bit patterns
    chosen by x). An item with "fail" raises, failing alone; one with "hold" waits at the gate (hold). A whole batch
    takes the first item's shape. torch is imported only for the shapes that need it."""

    @calque.enter
    def load(self):
        import numpy
        self.np = numpy

    @calque.batch
    def run(self, items):
        np, shape = self.np, items[0]["shape"]
        if any(item.get("hold") for item in items):
            hold(items)
        if any(item.get("fail") for item in items):
            raise ValueError("an item asked to fail")
        x = np.array([item["x"] for item in items])
        rows = x[:, None].astype(np.float32) + np.arange(4, dtype=np.float32) / 8          # [B, 4] float32
        bits = np.stack([x * 7919 % 65536 - 32768, -1 - x], axis=1).astype(np.int16)      # NaNs among them
        if shape in ("cuda", "bf16"):
            import torch
            return FakeCuda(torch.from_numpy(rows)) if shape == "cuda" else list(torch.from_numpy(bits).view(
                torch.bfloat16))
        return {"batch": rows, "short": rows[1:], "f16": list(bits.view(np.float16)),
                "i64": list(bits.astype(np.int64) * 2 ** 40),
                "dict": {"embedding": rows, "label": x * 3, "name": [f"n{v}" for v in x]}}[shape]


class FakeCuda:
    """A tensor on a device the host cannot read: .numpy() refuses, as torch does for a CUDA tensor; .cpu() gives
    the values (and is counted in the file $CPU_CALLS)."""

    def __init__(self, tensor):
        self.tensor, self.shape = tensor, tensor.shape

    def detach(self):
        return self

    def cpu(self):
        with open(os.environ["CPU_CALLS"], "a") as f:
            f.write("cpu\n")
        return self.tensor

    def numpy(self):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first")


class Embeddings:
    """The batch's [B, 256] float32 embeddings (seeded by the first item's x), as one array, the way a Hugging Face
    snippet returns them; with EMBED_AS=json, as lists of floats (what calque stored before typed results)."""

    @calque.enter
    def load(self):
        import numpy as np
        self.np, self.as_json = np, os.environ.get("EMBED_AS") == "json"

    @calque.batch
    def run(self, items):
        rows = self.np.random.default_rng(items[0]["x"]).standard_normal((len(items), 256), self.np.float32)
        return rows.tolist() if self.as_json else rows


class Spin:
    """Hashes each item's "spin" times (real work that paces a drain); an item with "error" raises ValueError
    with that text, so that only that item fails (the dashboard's test puts HTML in it); a batch with a "hold"
    item waits for $GATE_DIR/open as Gate does."""

    @calque.enter
    def load(self):
        pass

    @calque.batch
    def run(self, items):
        if any(item.get("hold") for item in items):
            hold(items)
        out = []
        for item in items:
            digest = b""
            for _ in range(item.get("spin", 0)):
                digest = hashlib.sha256(digest).digest()
            if "error" in item:
                raise ValueError(item["error"])
            out.append({"y": item["x"] * 2})
        return out

    def collate(self, items):
        return items


class Types:
    """Says what the worker received: per field, its Python type's name and the value as JSON."""

    @calque.enter
    def load(self):
        pass

    @calque.batch
    def run(self, items):
        return [{k: [type(v).__name__, v] for k, v in item.items()} for item in items]


class Threads:
    """Says the thread settings its worker was started with, and torch's thread count where torch is imported."""

    @calque.enter
    def load(self):
        pass

    @calque.batch
    def run(self, items):
        import calque_supervisor as supervisor
        return [{var: os.environ.get(var) for var in supervisor.THREAD_VARS} for _ in items]


class Steps:
    """Doubles x; a batch holding an item with "step": NAME announces $GATE_DIR/at-NAME, then waits for
    $GATE_DIR/NAME: a test walks a claim batch by batch (its progress within the claim)."""

    @calque.enter
    def load(self):
        pass

    @calque.batch
    def run(self, items):
        gate = os.environ["GATE_DIR"]
        for step in [item["step"] for item in items if "step" in item]:
            open(os.path.join(gate, f"at-{step}"), "w").close()
            while not os.path.exists(os.path.join(gate, step)):
                time.sleep(0.01)
        return [{"y": item["x"] * 2} for item in items]


class WholeClaim(Faulty):
    """Faulty, given each claim whole in one call (@calque.batch(whole_claim=True)); a call holding an item
    with "fail" raises; each call's item count is appended to $SIZES_FILE."""

    @calque.batch(whole_claim=True)
    def run(self, items):
        with open(os.environ["SIZES_FILE"], "a") as f:
            f.write(f"{len(items)}\n")
        if any(item.get("fail") for item in items):
            raise ValueError("an item asked to fail")
        return super().run(items)
