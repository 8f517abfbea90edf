"""Runnable examples of the training paradigms torchwire is for.

``parameter_server``, ``rnn``, ``pipeline``, ``rl`` and ``hybrid``: run one with
``python -m torchwire.examples.NAME`` (it starts its own local processes) or,
unchanged, under ``torchrun``.  See the README, "Examples".
"""
