import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _h import zc
def build(batch_size=8, image_size=64, *, device="cpu", dtype=torch.float32):
    timm = zc.import_timm()
    model = timm.create_model("resnet26d", pretrained=False, num_classes=10, drop_path_rate=0.1)
    return zc.image_classification(model, batch_size=batch_size, image_size=image_size, num_classes=10,
                                   device=device, dtype=dtype, seed=5400)
