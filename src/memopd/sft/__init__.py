"""Supervised fine-tuning on turn-level examples: data (examples, bin packing, data order), the
target-only loss (packed or padded), checkpoints, the trainer (student and teacher) and its benchmark."""
