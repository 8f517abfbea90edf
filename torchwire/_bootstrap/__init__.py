"""The bootstrap layer: rendezvous, dynamic groups, and wiring the runtime at ``init_rpc``."""
