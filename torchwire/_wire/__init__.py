"""The wire layer: bytes between two processes and nothing else.

Knows nothing of RPC semantics: frames, connections, listeners, the handshake
that authenticates a connection (auth) and optional TLS.
"""
