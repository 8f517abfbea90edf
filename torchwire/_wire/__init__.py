"""The wire layer: bytes between two processes and nothing else.

Knows nothing of RPC semantics: frames, connections and listeners.
"""
