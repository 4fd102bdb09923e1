"""The ML core: models, KV capture, alignment, projectors, fusion, losses, the Distiller (pure PyTorch + HF, no Ray)."""
