"""The base layer: errors, options, thread roles and other leaf modules.

Nothing here imports any other part of torchwire; every other layer may import it.
"""
