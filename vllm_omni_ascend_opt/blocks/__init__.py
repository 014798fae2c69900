"""Shared building blocks of the optimizations: written once, imported by the optimizations that use them.

Nothing here is an optimization or knows about the registry; an optimization never imports another optimization,
only these blocks (and, for families, its ``opts/_*`` base).
"""
