"""The pdlab router: an OpenAI-compatible front door that sends long prompts through prefill → decode."""
