"""The patched block body, the joint QKV path (eager and traced), two-segment modulation and compiled-block hoisting."""
