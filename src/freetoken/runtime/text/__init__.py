"""Text in and out: the tokenizer, the chat template, stop strings, anchors of hybrid checkpoints."""
