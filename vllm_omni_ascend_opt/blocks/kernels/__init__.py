"""On-device kernel verification: one verdict cache with one invalidation rule (``verdicts``), the verified NPU
rotary (``rotary``), RMSNorm (``rms_norm``) and attention (``npu_attention``) paths, and the RoPE tables and
portable rotary math they are checked against (``rope_tables``). A new kernel goes here, with its checks."""
