"""ViT as PyTorch defines it: torchvision.models.VisionTransformer with the configuration of
Tally's "vit" presets (nn/models/vit.cpp, ViTConfig::preset), 10 classes and 3 channels (the
registry's defaults), so the state dict of Tally's model loads with strict=True."""

import torch.nn.functional as F

# preset: (image_size, patch_size, num_layers, num_heads, hidden_dim, mlp_dim)
PRESETS = {
    "tiny": (32, 8, 2, 2, 64, 128),
    "vit_b_16": (224, 16, 12, 12, 768, 3072),
    "vit_b_32": (224, 32, 12, 12, 768, 3072),
    "vit_l_16": (224, 16, 24, 16, 1024, 4096),
}


def build(preset):
    from torchvision.models import VisionTransformer
    image_size, patch_size, num_layers, num_heads, hidden_dim, mlp_dim = PRESETS[preset]
    return VisionTransformer(image_size=image_size, patch_size=patch_size, num_layers=num_layers,
                             num_heads=num_heads, hidden_dim=hidden_dim, mlp_dim=mlp_dim,
                             dropout=0.0, attention_dropout=0.0, num_classes=10)


def loss(model, input, target):
    return F.cross_entropy(model(input), target)
