"""A Modal-shaped app over the demo model, written as for Modal (on Modal itself its image would also need the
examples folder and calque, which demo_model imports). On calque pools, from the repository root, where
`examples.demo_model` imports:

    python calque.py modal run examples/modal_app.py --count 20            # ephemeral local pools, deleted after
    python calque.py pool create --model demo-modal --handler examples/modal_app.py:Classifier.classify --workers 2
    python calque.py modal run examples/modal_app.py --pool demo-modal     # classify on the warm pool
    python calque.py submit --pool demo-modal examples/items.jsonl          # or the pool as any calque pool

docs/modal.md says what each construct does on a calque pool.
"""
import json

import modal

app = modal.App("calque-demo", image=modal.Image.debian_slim().pip_install("torch"))


@app.cls(gpu="A10G", retries=2, timeout=600)
class Classifier:
    @modal.enter()
    def load(self):
        from examples.demo_model import DemoModel   # torch and the weights load once per container / worker
        self.model = DemoModel()
        self.model.load()

    @modal.method()
    def classify(self, item):
        """One item {"text": ...} -> {"label", "score"}."""
        return self.model.predict([item])[0]

    @modal.batched(max_batch_size=16, wait_ms=100)
    def classify_batch(self, items):
        """Up to 16 items in one forward pass."""
        return self.model.predict(items)


@app.function()
def words(item):
    return len(item["text"].split())


@app.local_entrypoint()
def main(count: int = 10):
    items = [{"text": f"pool worker claim {i} " * (1 + i % 4)} for i in range(count)]
    one_by_one = list(Classifier().classify.map(items))
    batched = list(Classifier().classify_batch.map(items))
    print(json.dumps({"same": one_by_one == batched, "first": one_by_one[:3], "words": list(words.map(items))[:3]}))
