"""The convert stage: resolve a plan, quantize, write and publish an MLX folder, its card and hub upload."""
