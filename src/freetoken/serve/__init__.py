"""OpenAI/Anthropic-compatible serving."""
