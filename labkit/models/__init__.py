"""Models and caches: the readable Transformer, its forward paths, KV caches, loading and the model hub."""
