import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _h import zc, import_torchvision
def build(batch_size=8, image_size=96, *, device="cpu", dtype=torch.float32):
    tv = import_torchvision()
    model = tv.models.regnet_y_400mf(weights=None, num_classes=10)
    return zc.image_classification(model, batch_size=batch_size, image_size=image_size, num_classes=10,
                                   device=device, dtype=dtype, seed=5600)
