"""Distributed autograd's machinery (the public API is :mod:`torchwire.autograd`)."""
