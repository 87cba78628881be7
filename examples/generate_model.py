"""A text-generation handler as one is written from Hugging Face snippets: tokenizer and causal LM loaded once,
each batch left-padded, model.generate(max_new_tokens=24) greedy, the new tokens batch_decode'd. The model folder
is GENERATE_MODEL_DIR (default ./generate-model), built by examples/make_generate_model.py.

    python calque.py pool create --model gen --handler examples/generate_model.py:GenerateModel --workers 2
    python calque.py submit --pool gen prompts.jsonl

GenerateWholeClaim is the same handler given each claim whole in one call (@calque.batch(whole_claim=True)), as
an engine that batches for itself wants (vLLM's LLM.generate, SGLang, a pipeline()).
"""
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import calque

MAX_NEW_TOKENS = int(os.environ.get("GENERATE_NEW_TOKENS", "24"))   # tokens generated per prompt


class GenerateModel:
    @calque.enter
    def load(self):
        folder = os.environ.get("GENERATE_MODEL_DIR", "generate-model")
        if not os.path.isdir(folder):   # else transformers would take the name for a model on the Hugging Face hub
            raise FileNotFoundError(f"no model folder {os.path.abspath(folder)}: build it with "
                                    f"examples/make_generate_model.py, or set GENERATE_MODEL_DIR")
        self.tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()

    @calque.batch
    def generate(self, items):
        return self._generate(items)

    def _generate(self, items):
        batch = self.tokenizer([item["prompt"] for item in items], padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = self.model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id)
        return self.tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)


class GenerateWholeClaim(GenerateModel):
    @calque.batch(whole_claim=True)
    def generate(self, items):
        return self._generate(items)
