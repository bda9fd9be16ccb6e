"""Cache objects <-> bytes: mlx-lm prompt-cache safetensors, validated before mlx sees a byte."""
