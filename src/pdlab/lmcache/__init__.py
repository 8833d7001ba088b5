"""LMCache on the local tier: its settings (one computation for the laptop and the cluster), the CPU KV connector
vLLM loads in each instance (`pdlab.lmcache.connector`), and LMCache's own figures read back from an instance.

Only `settings` and `figures` are imported by the rest of pdlab; `connector` runs inside vLLM processes (it imports
vLLM, torch and LMCache)."""
