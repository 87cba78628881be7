"""Handlers the tests run in real warmd.py processes."""
import os
import time

import calque


class Echo:
    """Doubles x; an item with "fail" raises, so only that item fails; counts @enter calls in a file."""

    @calque.enter
    def load(self):
        self.loaded = True

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
        self.dir = os.environ["GATE_DIR"]

    @calque.batch
    def run(self, items):
        with open(os.path.join(self.dir, f"started-{os.getpid()}"), "w") as f:
            f.write(str(len(items)))
        while not os.path.exists(os.path.join(self.dir, "open")):
            time.sleep(0.01)
        return [{"y": item["x"] * 2, "pid": os.getpid()} for item in items]


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
