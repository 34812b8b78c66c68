"""Framework-free core of metastore_plugins: depends on torch, safetensors and numpy only."""
