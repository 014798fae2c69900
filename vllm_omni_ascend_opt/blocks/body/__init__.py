"""The patched block body and the joint QKV path (eager, and as written for compiled graphs), the two-segment
modulation they apply, and the hoisting of per-step values into regionally compiled blocks. A new way to run part of
a block goes here."""
