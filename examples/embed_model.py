"""A text-embedding handler as one is written for Hugging Face models: tokenizer and encoder loaded once, each
batch mean-pooled over its tokens and L2-normalised, returned as the batch's [B, 256] tensor. The model folder
is EMBED_MODEL_DIR (default ./embed-model), built by examples/make_embed_model.py.

    python calque.py pool create --model embed --handler examples/embed_model.py:EmbedModel --workers 2
    python calque.py submit --pool embed texts.parquet --columns text
"""
import os

import torch
from transformers import AutoModel, AutoTokenizer

import calque


class EmbedModel:
    @calque.enter
    def load(self):
        folder = os.environ.get("EMBED_MODEL_DIR", "embed-model")
        if not os.path.isdir(folder):   # else transformers would take the name for a model on the Hugging Face hub
            raise FileNotFoundError(f"no model folder {os.path.abspath(folder)}: build it with "
                                    f"examples/make_embed_model.py, or set EMBED_MODEL_DIR")
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder).eval()

    @calque.batch
    def embed(self, items):
        batch = self.tokenizer([item["text"] for item in items], padding=True, truncation=True, max_length=256,
                               return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(mean, dim=-1)
