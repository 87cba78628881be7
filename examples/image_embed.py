"""An image-embedding handler as one is written for Hugging Face models: image processor and ViT loaded once (on
the GPU where there is one); collate decodes each item's JPEG/PNG bytes with Pillow (ahead of the model, in the
worker's pipeline) into the processor's pixel values; the batch returns the ViT's pooled embedding, a [B, 192]
tensor. One handler serves a folder of files (items {"path", "bytes"}) and a Parquet Image column (items
{"image": {"bytes", "path"}}). The model folder is IMAGE_MODEL_DIR (default ./vit-model), built by
examples/make_media.py.

    python calque.py pool create --model vit --handler examples/image_embed.py:ImageEmbed --workers 2
    python calque.py submit --pool vit photos/ --id-field path
    python calque.py submit --pool vit images.parquet
"""
import io
import os

import torch
from PIL import Image
from transformers import AutoImageProcessor, ViTModel

import calque


def image_bytes(item):
    """The bytes an item carries: a file's, or a Hugging Face Image column's."""
    return item["bytes"] if "bytes" in item else item["image"]["bytes"]


class ImageEmbed:
    @calque.enter
    def load(self):
        folder = os.environ.get("IMAGE_MODEL_DIR", "vit-model")
        if not os.path.isdir(folder):   # else transformers would take the name for a model on the Hugging Face hub
            raise FileNotFoundError(f"no model folder {os.path.abspath(folder)}: build it with "
                                    f"examples/make_media.py, or set IMAGE_MODEL_DIR")
        self.processor = AutoImageProcessor.from_pretrained(folder, backend="pil")   # Pillow + numpy, no torchvision
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = ViTModel.from_pretrained(folder).eval().to(self.device)

    def collate(self, items):
        """[B, 3, 224, 224] pixel values. A corrupt image raises Pillow's error: calque then runs the batch's
        items one by one, so that item alone fails with it."""
        images = [Image.open(io.BytesIO(image_bytes(item))).convert("RGB") for item in items]
        return self.processor(images, return_tensors="pt")["pixel_values"]

    @calque.batch
    def embed(self, pixel_values):
        with torch.inference_mode():
            return self.model(pixel_values=pixel_values.to(self.device, non_blocking=True)).pooler_output
