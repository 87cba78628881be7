"""The image handler bench_media_in.py measures: collate decodes each item's JPEG with Pillow (which releases
the GIL while it decodes) into one uint8 [B, H, W, 3] array; the batch runs a small convolutional net on it (on the GPU where there is one: `make gpu-check`). A
file's item is {"path", "bytes"}, an HF Image column's {"image": {"bytes", "path"}}: both are served."""
import io

import calque


class ImageNet:
    @calque.enter
    def load(self):
        import torch
        torch.manual_seed(0)
        self.torch, self.device = torch, "cuda" if torch.cuda.is_available() else "cpu"
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 5, stride=2), torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 5, stride=2),
            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 8)).eval()
        self.net.to(self.device)

    def collate(self, items):
        import numpy as np
        from PIL import Image
        images = []
        for item in items:
            data = item["bytes"] if "bytes" in item else item["image"]["bytes"]
            images.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB").resize((128, 128))))
        return np.stack(images)

    @calque.batch
    def run(self, images):
        x = self.torch.from_numpy(images).to(self.device).permute(0, 3, 1, 2).float() / 255
        with self.torch.no_grad():
            return self.net(x)
