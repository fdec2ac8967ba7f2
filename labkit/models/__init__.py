"""Models and what they need: the readable Transformer and its layers, its forward paths and their
calibration, KV caches, the Target protocol and the adapters that make other models targets, the
draft heads (Medusa, EAGLE) and their checkpoints, the multi-token model, the target minus some
layers, loading and its checks, and the model hub. No decode loop and no drafter lives here."""
