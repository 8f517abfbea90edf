"""The wire layer: bytes between two processes and nothing else.

Knows nothing of RPC semantics: frames (``frame.py``), connections (``connection.py``
with its ``writer.py`` and ``reader.py``), how tensor buffers travel (``channels/``),
listeners, the handshake that authenticates a connection (``auth.py``) and optional
TLS (``tls.py``).  Operating-system errors end here: what leaves this layer is a
torchwire error (``LinkError`` and its kinds, ``ProtocolError``,
``AuthenticationError``).
"""

