"""On-device kernel verification: one verdict cache with one invalidation rule (``verdicts``), saved on disk
(``saved``) and agreed between ranks (``agree``); one guard for every check and kernel call (``guard``: a fault costs
one call); the verified NPU rotary (``rotary``), RMSNorm (``rms_norm``) and attention (``npu_attention``) paths, and
the RoPE tables and portable rotary math they are checked against (``rope_tables``); the FRACTAL_NZ weight checks
(``nz_check``). A new kernel goes here, with its checks, behind the guard."""
