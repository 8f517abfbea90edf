"""The agent layer: one RPC runtime per process (calls, serving, links, shutdown)."""

from .agent import AgentState, RpcAgent

__all__ = ["AgentState", "RpcAgent"]
